"""A task waiting for its version holds no place in the engine.

An eval round issued at a version the engine has not loaded yet waits in
the rollout loop (its lease kept alive). When such tasks filled the
engine's places, a round at the engine's own version, leased behind them,
could not start, and its eval hold kept the engine from the version the
waiting tasks needed: the mixed run stalled there for good. Here the
rollout loop's own scheduling (``RolloutLoop._start_waiting`` and
``_handle``) runs against a stand-in engine, scorer and JetStream that
record what they are given (the loop over real NATS and vLLM:
tests/generator/test_swap.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from asymptote.compute import ComputeMeter
from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names
from asymptote.sample import Sample
from services.generator.metrics import GeneratorMetrics
from services.generator.rollout import RolloutLoop
from services.generator.swapper import EvalHold
from tests.helpers.waiting import wait_until_async


class Engine:
    """Samples one token per completion at its version; records the prompts it sampled."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.sampled: list[str] = []
        self.running = 0
        self.most_running = 0
        self._changed = asyncio.Condition()
        self.release = asyncio.Event()
        self.release.set()

    async def load(self, version: int) -> None:
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    async def wait_for_version(self, version: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.version >= version)

    async def sample(self, prompt: str, n: int, *_: Any) -> tuple[list[int], list[Sample]]:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await self.release.wait()
            self.sampled.append(prompt)
            return [1], [Sample([2], [-0.1], [(self.version, 0, 1)], "stop", "x") for _ in range(n)]
        finally:
            self.running -= 1


class Scorer:
    def check(self, task: rollout_pb2.GenerationTask) -> None:
        pass

    def prompt(self, task_name: str, prompt: str) -> str:
        return prompt

    def length_control(self, task_name: str) -> None:
        return None

    async def rewards(self, task_name: str, completions: list[str], reference: str) -> list[float]:
        return [1.0 for _ in completions]


class JetStream:
    def __init__(self) -> None:
        self.published: list[str] = []

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        self.published.append(headers["Nats-Msg-Id"])


class Msg:
    def __init__(self, task: rollout_pb2.GenerationTask) -> None:
        self.data = task.SerializeToString()
        self.headers = {"Nats-Msg-Id": task.task_id}
        self.acked = False

    async def ack(self) -> None:
        self.acked = True

    async def nak(self, delay: float | None = None) -> None:
        raise AssertionError("no task is handed back here")

    async def in_progress(self) -> None:
        pass


def eval_task(version: int, i: int) -> Msg:
    return Msg(
        rollout_pb2.GenerationTask(
            task_id=f"eval-v{version}-{i}",
            prompt=f"v{version} prompt {i}",
            kind=rollout_pb2.TASK_KIND_EVAL,
            require_version=version,
            issued_at_version=version,
            sampling=rollout_pb2.SamplingParams(num_samples=1, max_tokens=4, temperature=1.0),
        )
    )


def rollout_loop(engine: Engine, js: JetStream, hold: EvalHold, places: int) -> RolloutLoop:
    return RolloutLoop(
        engine,  # type: ignore[arg-type]
        js,  # type: ignore[arg-type]
        Names(),
        "gen-test",
        max_inflight_groups=places,
        ack_wait_s=30.0,
        metrics=GeneratorMetrics(),
        meter=ComputeMeter("generator", "gen-test", "cpu", 1),
        scorer=Scorer(),  # type: ignore[arg-type]
        hold=hold,
    )


async def test_a_round_at_the_engines_version_starts_while_a_later_round_waits() -> None:
    engine, js, hold = Engine(version=2), JetStream(), EvalHold(max_versions=4)
    loop = rollout_loop(engine, js, hold, places=2)
    # Leased in this order: the round issued at version 4 fills both places before the round at 2.
    later = [eval_task(4, i) for i in range(2)]
    current = [eval_task(2, i) for i in range(3)]
    for msg in later + current:
        loop._hold_for(msg)  # type: ignore[arg-type]
    loop._waiting.extend(later + current)  # type: ignore[arg-type]
    assert hold.holds(2, 4)  # the round at 2 keeps the engine at 2 until it is sampled
    loop._start_waiting()

    async def published(ids: set[str]) -> bool:
        return set(js.published) == ids

    await wait_until_async(lambda: published({f"eval-v2-{i}" for i in range(3)}), 5, "the round at version 2")
    assert not hold.holds(2, 4)  # its tasks done, the swap to 4 may go on
    assert engine.sampled == [f"v2 prompt {i}" for i in range(3)]
    assert len(loop._inflight) == 2 and loop._parked == 2  # the later round still waits, holding no place
    await engine.load(4)
    every = {f"eval-v{v}-{i}" for v, n in ((2, 3), (4, 2)) for i in range(n)}
    await wait_until_async(lambda: published(every), 5, "the round at version 4")
    await wait_until_async(lambda: _idle(loop), 5, "every task to finish")
    assert engine.sampled[3:] == ["v4 prompt 0", "v4 prompt 1"]
    assert engine.most_running <= 2


async def test_tasks_freed_from_waiting_still_share_the_engines_places() -> None:
    engine, js, hold = Engine(version=0), JetStream(), EvalHold(max_versions=0)
    loop = rollout_loop(engine, js, hold, places=2)
    parked = [eval_task(1, i) for i in range(4)]
    loop._waiting.extend(parked)  # type: ignore[arg-type]
    loop._start_waiting()
    await wait_until_async(lambda: _parked(loop, 4), 5, "the four tasks to wait for version 1")
    engine.release.clear()
    await engine.load(1)
    await wait_until_async(lambda: _running(engine, 2), 5, "two tasks in the engine")
    assert engine.running == 2  # four freed at once, two places: the other two wait for a place
    engine.release.set()
    await wait_until_async(lambda: _idle(loop), 5, "every task to finish")
    assert len(js.published) == 4 and engine.most_running == 2


async def _idle(loop: RolloutLoop) -> bool:
    return not loop._inflight and not loop._waiting


async def _parked(loop: RolloutLoop, n: int) -> bool:
    return loop._parked == n


async def _running(engine: Engine, n: int) -> bool:
    return engine.running == n
