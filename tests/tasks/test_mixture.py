"""A mixture of tasks: the draw by ratio, the digest, the per-sub-task curricula and the broker's tasks.

The sub-tasks here are two small arithmetic tasks (no files, no sandbox):
``add`` (sums) and ``sub`` (differences), weighted 3 to 1. The broker is
driven without NATS: a recording stand-in takes what it publishes.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from pydantic import ValidationError

from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names
from asymptote.tasks import MixtureSettings, MixtureTask, get_task, parse_task_settings, task_digest
from asymptote.tasks.mixture import next_sub_task
from services.broker.config import BrokerConfig
from services.broker.curriculum import MixtureCurriculum
from services.broker.metrics import BrokerMetrics
from services.broker.pipeline import BrokerPipeline
from services.local.workloads import workload_task

ADD = {"name": "arithmetic", "operations": ["+"], "num_train": 12, "num_heldout": 4, "seed": 1}
SUB = {"name": "arithmetic", "operations": ["-"], "num_train": 8, "num_heldout": 6, "seed": 2}


def mixture(add_weight: float = 3.0, sub_weight: float = 1.0, **add: Any) -> MixtureSettings:
    settings = parse_task_settings(
        {
            "name": "mixture",
            "tasks": [
                {"name": "add", "weight": add_weight, "task": {**ADD, **add}},
                {"name": "sub", "weight": sub_weight, "task": SUB},
            ],
        }
    )
    assert isinstance(settings, MixtureSettings)
    return settings


def draws(weights: dict[str, float], n: int, seed: int = 0) -> list[str]:
    counts: Counter[str] = Counter()
    out = []
    for _ in range(n):
        name = next_sub_task(weights, counts, seed)
        counts[name] += 1
        out.append(name)
    return out


def test_the_draw_follows_the_ratios_worked_out_by_hand() -> None:
    # 3:1, each draw to the larger deficit (n + 1) * w / 4 - count, by hand:
    # n=0: a .75, b .25 -> a;  n=1: a .50, b .50 -> the seeded tie-break.  If a: n=2 a .25, b .75 -> b;
    # n=3 a 1, b 0 -> a (a a b a).  If b: n=2 a 1.25, b -.25 -> a; n=3 a 1, b 0 -> a (a b a a).  Then again.
    sequence = draws({"a": 3.0, "b": 1.0}, 8, seed=0)
    assert sequence[:4] in (["a", "a", "b", "a"], ["a", "b", "a", "a"]) and sequence[4:] == sequence[:4]
    assert Counter(sequence[:4]) == {"a": 3, "b": 1} and Counter(sequence) == {"a": 6, "b": 2}
    # 1:1 alternates; which comes first is the seeded tie-break, the same for the same seed.
    even = draws({"a": 1.0, "b": 1.0}, 6, seed=0)
    assert even in (["a", "b"] * 3, ["b", "a"] * 3)
    assert draws({"a": 1.0, "b": 1.0}, 6, seed=0) == even
    assert {draws({"a": 1.0, "b": 1.0}, 2, seed=s)[0] for s in range(20)} == {"a", "b"}  # the seed picks
    # 2:1:1 over 400 draws: exactly 200, 100, 100, and every prefix within one of each share.
    weights = {"a": 2.0, "b": 1.0, "c": 1.0}
    long = draws(weights, 400, seed=7)
    assert Counter(long) == {"a": 200, "b": 100, "c": 100}
    seen: Counter[str] = Counter()
    for n, name in enumerate(long, start=1):
        seen[name] += 1
        assert all(abs(seen[k] - n * w / 4.0) < 1.0 for k, w in weights.items()), (n, seen)


def test_the_digest_covers_the_mixture_and_its_weights() -> None:
    base = task_digest(mixture())
    assert task_digest(mixture()) == base
    assert task_digest(mixture(add_weight=2.0)) != base
    assert task_digest(mixture(seed=5)) != base  # a sub-task's own settings
    renamed = mixture().model_dump()
    renamed["tasks"][1]["name"] = "minus"
    assert task_digest(MixtureSettings.model_validate(renamed)) != base
    # How a generator runs its scoring is not what a reward means; the words-code sub-task's verifier is.
    words = {"name": "code", "weight": 1.0, "task": workload_task("words-code").model_dump()}
    with_words = MixtureSettings.model_validate({"tasks": [mixture().tasks[0].model_dump(), words]})
    workers = with_words.model_dump()
    workers["tasks"][1]["task"].update(num_score_workers=7, score_timeout_s=60.0)
    assert task_digest(MixtureSettings.model_validate(workers)) == task_digest(with_words)
    workers["tasks"][1]["task"]["verifier"]["test_timeout_s"] = 1.0
    assert task_digest(MixtureSettings.model_validate(workers)) != task_digest(with_words)


def test_settings_refuse_repeated_names_and_a_single_task() -> None:
    with pytest.raises(ValidationError, match="unique; repeated: add"):
        parse_task_settings({"name": "mixture", "tasks": [{"name": "add", "weight": 1, "task": ADD}] * 2})
    with pytest.raises(ValidationError, match="at least 2"):
        parse_task_settings({"name": "mixture", "tasks": [{"name": "add", "weight": 1, "task": ADD}]})
    with pytest.raises(ValidationError, match="greater than 0"):
        mixture(add_weight=0.0)


def test_problems_carry_their_sub_task_and_are_scored_by_it() -> None:
    task = get_task("mixture", mixture())
    assert isinstance(task, MixtureTask)
    train = task.problems("train")
    assert len(train) == 12 + 8 and len({p.prompt_id for p in train}) == 20
    assert Counter(task.sub_task_of(p.prompt_id) for p in train) == {"add": 12, "sub": 8}
    assert all(p.prompt_id.startswith(f"{task.sub_task_of(p.prompt_id)}-") for p in train)
    sub = next(p for p in train if task.sub_task_of(p.prompt_id) == "sub")
    assert "-" in sub.prompt and task.score_in("sub", sub.reference, sub.reference) == 1.0
    with pytest.raises(TypeError, match="score_in"):
        task.score("1", "1")


def test_each_sub_task_keeps_its_own_curriculum_and_a_resumed_one_continues() -> None:
    task = get_task("mixture", mixture())
    assert isinstance(task, MixtureTask)
    curriculum = MixtureCurriculum(task, seed=3, retire_at=0.9)
    first = [curriculum.next() for _ in range(16)]
    by_task = Counter(task.sub_task_of(p.prompt_id) for p, _, _ in first)
    assert by_task == {"add": 12, "sub": 4}
    adds = [p.prompt_id for p, _, _ in first if task.sub_task_of(p.prompt_id) == "add"]
    assert len(set(adds)) == 12 and {e for p, e, _ in first if p.prompt_id in adds} == {0}  # one epoch of add
    assert curriculum.counts() == {"add": 12, "sub": 4} and curriculum.state.num_issued == 16
    # Saved and read back (as the broker's KV does), the sequence goes on as it would have.
    saved = curriculum.state.SerializeToString()
    ahead = [curriculum.next()[0].prompt_id for _ in range(10)]
    resumed = MixtureCurriculum(task, seed=99, retire_at=0.9, state=rollout_pb2.CurriculumState.FromString(saved))
    assert [resumed.next()[0].prompt_id for _ in range(10)] == ahead
    # A rewind undoes draws in every sub-task.
    mark = resumed.mark()
    again = [resumed.next()[0].prompt_id for _ in range(3)]
    resumed.rewind(mark)
    assert [resumed.next()[0].prompt_id for _ in range(3)] == again
    # Pass rates go to the prompt's own sub-task; a prompt of no sub-task is ignored.
    resumed.record(ahead[0], 1.0)
    resumed.record("elsewhere-1", 1.0)
    name = task.sub_task_of(ahead[0])
    assert dict(resumed.state.sub_tasks[name].pass_rates) == {ahead[0]: 1.0}
    assert resumed.num_retired == 1


class Recorder:
    """Stands in for JetStream and the curriculum bucket: keeps what is published and saved."""

    def __init__(self) -> None:
        self.published: list[rollout_pb2.GenerationTask] = []
        self.saved = 0

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str] | None = None) -> None:
        self.published.append(rollout_pb2.GenerationTask.FromString(payload))

    async def put(self, key: str, value: bytes) -> None:
        self.saved += 1


def test_the_broker_names_each_tasks_sub_task_and_holds_a_round_per_sub_task() -> None:
    config = BrokerConfig(task=mixture(), batch_prompts=4)
    recorder = Recorder()
    pipeline = BrokerPipeline(config, recorder, Names(), recorder, None, BrokerMetrics())  # type: ignore[arg-type]
    task = pipeline.task
    assert isinstance(task, MixtureTask)
    pipeline.curriculum = MixtureCurriculum(task, config.seed, config.pass_rate_retire)
    train = [pipeline._train_task(*pipeline.curriculum.next()) for _ in range(8)]
    assert Counter(t.task_name for t in train) == {"add": 6, "sub": 2}
    assert all(t.task_digest == task_digest(config.task) for t in train)
    assert all(task.sub_task_of(t.prompt_id) == t.task_name for t in train)
    # The eval budget (10 prompts here) is split evenly, and what add cannot take (its 4 of 5) goes to sub.
    asyncio.run(pipeline.issue_eval_round(0))
    rounds = Counter((t.eval_id, t.task_name, t.eval_num_prompts) for t in recorder.published)
    assert rounds == {("eval-v0-add", "add", 4): 4, ("eval-v0-sub", "sub", 6): 6}
    assert all(t.task_id == f"{t.eval_id}-{t.prompt_id}" for t in recorder.published)
    assert recorder.saved == 1
    # A set number of prompts is split: 5 gives add 3 (ceil(5 / 2)) and sub the 2 left. Without one, the
    # max_share budget (8 here: 0.1 x 10 versions x 4 x 8 / 4 samples) gives 4 and 4, and min_prompts 5
    # raises each round to at least 5 of its split: add has only 4.
    fixed = BrokerConfig(task=mixture(), batch_prompts=4, eval={"num_prompts": 5})
    split = BrokerPipeline(fixed, recorder, Names(), recorder, None, BrokerMetrics())  # type: ignore[arg-type]
    assert {name: len(problems) for name, problems in split.eval_sets.items()} == {"add": 3, "sub": 2}
    floor = BrokerConfig(task=mixture(), batch_prompts=4, eval={"min_prompts": 5})
    least = BrokerPipeline(floor, recorder, Names(), recorder, None, BrokerMetrics())  # type: ignore[arg-type]
    assert {name: len(problems) for name, problems in least.eval_sets.items()} == {"add": 4, "sub": 5}


def test_a_single_task_broker_issues_as_it_always_did() -> None:
    config = BrokerConfig(task=parse_task_settings(ADD), batch_prompts=4)
    recorder = Recorder()
    pipeline = BrokerPipeline(config, recorder, Names(), recorder, None, BrokerMetrics())  # type: ignore[arg-type]
    from services.broker.curriculum import Curriculum

    pipeline.curriculum = Curriculum(pipeline._train, config.seed, config.pass_rate_retire)
    assert {pipeline._train_task(*pipeline.curriculum.next()).task_name for _ in range(4)} == {"arithmetic"}
    asyncio.run(pipeline.issue_eval_round(0))
    assert {(t.eval_id, t.task_name, t.eval_num_prompts) for t in recorder.published} == {("eval-v0", "arithmetic", 4)}
