"""A multi-turn task's place in the engine: held while one of its episodes samples, parked while all of
them wait on their environment, and given back when the task ends, also when one of its episodes fails.

The rollout loop's own ``_play`` and ``EnginePlace`` run here with an episode runner that stands in for
the engine and the environment workers: each episode enters the place to "sample" and leaves it to
"wait on its environment", on events the test sets, so that every interleaving is chosen rather than hoped
for. With a real engine, real environment workers and a broker:
tests/integration/test_multiturn_rollout.py::test_a_task_waiting_on_its_environment_leaves_its_engine_place_to_another.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from test_multiturn_group import offline_loop

from asymptote.contracts.v1 import rollout_pb2
from asymptote.envs import EnvTask
from services.generator.engine import Engine
from services.generator.episode import Episode, EpisodeRunner
from services.generator.mixing import Scorer
from services.generator.rollout import RolloutLoop
from tests.helpers.waiting import wait_until_async


@dataclass
class Script:
    """One episode: sample (inside the place) until ``sampled``, then wait on the environment until
    ``answered``; ``fail`` raises instead of sampling."""

    sampled: asyncio.Event = field(default_factory=asyncio.Event)
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    fail: bool = False
    sampling: bool = False
    cancelled: bool = False


class ScriptedRunner:
    """Plays episode i of a task by ``scripts[i]``."""

    settings = type("Settings", (), {"max_turns": 2})()

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = scripts
        self.started = 0

    async def run(
        self,
        task: EnvTask,
        temperature: float,
        top_p: float,
        seed: int = 0,
        place: contextlib.AbstractAsyncContextManager[Any] | None = None,
    ) -> Episode:
        assert place is not None
        script = self.scripts[self.started]
        self.started += 1
        if script.fail:
            raise RuntimeError("the engine refused the turn")
        try:
            async with place:
                script.sampling = True
                try:
                    await script.sampled.wait()
                finally:
                    script.sampling = False
            await script.answered.wait()
        except asyncio.CancelledError:
            script.cancelled = True
            raise
        return cast(Episode, object())


def loop_with(runner: ScriptedRunner) -> RolloutLoop:
    """A rollout loop with one place in its engine; nothing but its accounting and ``_play`` is used."""
    return offline_loop(cast(Engine, None), scorer=cast(Scorer, object()), episodes=cast(EpisodeRunner, runner))


def task(num_samples: int) -> rollout_pb2.GenerationTask:
    return rollout_pb2.GenerationTask(
        task_id="t", reference="r", sampling=rollout_pb2.SamplingParams(num_samples=num_samples, temperature=1.0)
    )


def held(loop: RolloutLoop) -> bool:
    """Whether the engine's one place is taken."""
    return loop._slots.locked()


async def until(condition: Callable[[], bool], what: str) -> None:
    async def holds() -> bool:
        return condition()

    await wait_until_async(holds, 5, what)


async def test_the_place_is_held_while_any_episode_samples_and_parked_while_all_wait() -> None:
    first, second = Script(), Script()
    loop = loop_with(ScriptedRunner([first, second]))
    playing = asyncio.create_task(loop._play(task(2), "prompt"))
    # The task's episodes sample together in its one place (a group is batched in the engine).
    await until(lambda: first.sampling and second.sampling, "both episodes to sample")
    assert held(loop) and loop._parked == 0
    first.sampled.set()  # one waits on its environment, the other still samples: the place stays
    await until(lambda: not first.sampling, "the first episode's turn to end")
    assert held(loop) and loop._parked == 0
    second.sampled.set()  # both wait on their environment: the place is free, the task parked
    await until(lambda: not held(loop), "the place to be given back")
    assert loop._parked == 1
    first.answered.set()
    second.answered.set()
    assert len(await playing) == 2
    assert not held(loop) and loop._parked == 0


async def test_an_episode_that_fails_stops_the_task_s_others_and_gives_the_place_back() -> None:
    sampling, failing = Script(), Script(fail=True)
    loop = loop_with(ScriptedRunner([sampling, failing]))
    with pytest.raises(RuntimeError, match="the engine refused the turn"):
        await loop._play(task(2), "prompt")
    # The task is handed back: its other episode was stopped mid-turn, not left sampling for nobody.
    assert sampling.cancelled and not sampling.sampling
    assert not held(loop) and loop._parked == 0
