"""A multi-turn group as the generator builds it from its episodes, and as the broker's staleness gate reads it.

No engine and no NATS: episodes are written here, with weight swaps in
mid-episode (version spans of several versions), one episode re-rendered
into two sequences, and environment tokens between turns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asymptote.compute import ComputeMeter
from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names
from asymptote.messages import decode_group
from asymptote.sample import Sample
from asymptote.tasks import ArithmeticSettings
from services.broker.batcher import Batcher
from services.generator.config import EngineSettings
from services.generator.engine import Engine
from services.generator.episode import Episode, TrainingSample
from services.generator.metrics import GeneratorMetrics
from services.generator.rollout import NoSequence, RolloutLoop, episode_completions
from services.generator.scoring import TaskScorer

PROMPT = [1, 2, 3]


def sample(tokens: list[int], spans: list[tuple[int, int, int]], mask: list[int] | None = None) -> Sample:
    m = mask or [1] * len(tokens)
    return Sample(tokens, [-0.5 if x else 0.0 for x in m], spans, "stop", "t" * len(tokens), loss_mask=mask or [])


def episodes() -> list[Episode]:
    """Episode 0: one sequence, turn at version 4, two environment tokens, turn at 5. Episode 1: two sequences
    (re-rendered), the first at version 2, the second on its own prompt at 3 then 6."""
    first = Episode(
        [TrainingSample(PROMPT, sample([7, 8, 20, 21, 9], [(4, 0, 2), (5, 4, 5)], [1, 1, 0, 0, 1]))], "done", 1.0, 2, ""
    )
    second = Episode(
        [
            TrainingSample(PROMPT, sample([10, 11], [(2, 0, 2)])),
            TrainingSample([1, 2, 3, 10, 11, 30, 31], sample([12, 13, 14], [(3, 0, 1), (6, 1, 3)])),
        ],
        "max_turns",
        None,
        2,
        "t",
        num_resplits=1,
    )
    return [first, second]


def offline_loop(engine: Engine, **overrides: Any) -> RolloutLoop:
    """A rollout loop with no JetStream and one place in its engine: for building groups (``_group``) or
    driving its accounting by hand, never for running. ``overrides``: more of RolloutLoop's arguments (the
    scorer: the arithmetic task's unless given)."""
    if "scorer" not in overrides:
        overrides["scorer"] = TaskScorer(ArithmeticSettings(), engine.settings.model_dir, GeneratorMetrics())
    return RolloutLoop(
        engine,
        None,  # type: ignore[arg-type]
        Names(),
        "gen",
        max_inflight_groups=1,
        ack_wait_s=30.0,
        metrics=GeneratorMetrics(),
        meter=ComputeMeter("generator", "gen", "cpu", 1),
        **overrides,
    )


def test_the_group_holds_every_sequence_its_prompt_and_its_episode(tmp_path: Path) -> None:
    eps = episodes()
    prompt_ids, completions = episode_completions(eps, [1.0, 0.0])
    assert prompt_ids == PROMPT
    assert [list(c.token_ids) for c in completions] == [[7, 8, 20, 21, 9], [10, 11], [12, 13, 14]]
    # Only the re-rendered sequence carries a prompt of its own; it continues its episode, with its reward.
    assert [list(c.prompt_token_ids) for c in completions] == [[], [], [1, 2, 3, 10, 11, 30, 31]]
    assert [c.continues_episode for c in completions] == [False, False, True]
    assert [c.reward for c in completions] == [1.0, 0.0, 0.0]
    assert list(completions[0].loss_mask) == [1, 1, 0, 0, 1]

    loop = offline_loop(Engine(EngineSettings(model_dir=tmp_path)))  # never started
    task = rollout_pb2.GenerationTask(task_id="t-1", prompt="p")
    group = loop._group(task, prompt_ids, completions, [t.sample for e in eps for t in e.samples], started=0.0)
    # Over every version span of every sequence: the oldest is the first sequence of the second episode.
    assert (group.min_version, group.max_version) == (2, 6)
    decode_group(group.SerializeToString())  # the broker takes it

    # The staleness gate reads the oldest version: k = 3 admits the group at learner version 5, not at 6.
    batcher = Batcher(batch_prompts=1, max_staleness_versions=3)
    assert not batcher.is_stale(group, learner_version=5)
    assert batcher.is_stale(group, learner_version=6)


def test_an_episode_without_a_sequence_is_left_out_and_a_group_of_none_refused() -> None:
    failed = Episode([], "env_timeout", None, 0, "", error="no answer within 10s")
    prompt_ids, completions = episode_completions([failed, *episodes()], [0.0, 1.0, 0.0])
    # The failed episode first: the group's prompt is the first sequence's that exists, the rewards stay aligned.
    assert prompt_ids == PROMPT
    assert [list(c.token_ids) for c in completions] == [[7, 8, 20, 21, 9], [10, 11], [12, 13, 14]]
    assert [c.reward for c in completions] == [1.0, 0.0, 0.0]
    with pytest.raises(
        NoSequence, match=r"none of the task's 2 episodes produced a sequence \(env_timeout: no answer within 10s\)"
    ):
        episode_completions([failed, failed], [0.0, 0.0])
