"""The multi-turn task: its settings, its digest, and the broker issuing its problems as a dataset task's.

The broker is driven without NATS: a recording stand-in takes what it
publishes (as in test_mixture.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from asymptote.jetstream.names import Names
from asymptote.messages import GROUP_BYTES_PER_TOKEN, max_group_bytes
from asymptote.tasks import MultiTurnSettings, MultiTurnTask, get_task, parse_task_settings, task_digest
from asymptote.tasks.multiturn import episode_prompt
from services.broker.config import BrokerConfig
from services.broker.curriculum import Curriculum
from services.broker.metrics import BrokerMetrics
from services.broker.pipeline import BrokerPipeline
from tests.tasks.test_mixture import Recorder

ROWS = [{"id": f"q{i}", "prompt": f"Count to {i}.", "answer": str(i)} for i in range(1, 11)]


def settings(path: Path, dataset: dict[str, Any] | None = None, **environment: Any) -> MultiTurnSettings:
    value = parse_task_settings(
        {
            "name": "multiturn",
            "dataset": {"path": str(path), "holdout_fraction": 0.2, "prompt_format": "Q: {prompt}", **(dataset or {})},
            "environment": {"entry": "tests.envs.tool_classes:Counter", **environment},
        }
    )
    assert isinstance(value, MultiTurnSettings)
    return value


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_problems_prompts_and_final_turn_scores_are_the_datasets(data: Path) -> None:
    s = settings(data)
    task = get_task("multiturn", s)
    assert isinstance(task, MultiTurnTask)
    train, heldout = task.problems("train"), task.problems("heldout")
    assert (len(train), len(heldout)) == (8, 2)
    assert sorted(p.prompt_id for p in [*train, *heldout]) == sorted(r["id"] for r in ROWS)
    assert episode_prompt(s, train[0].prompt) == f"Q: {train[0].prompt}"
    # The dataset's verifier (math) and reward style (binary) judge a final turn.
    assert task.score("so it is \\boxed{3}", "3") == 1.0
    assert task.score("so it is \\boxed{4}", "3") == 0.0


def test_the_digest_covers_the_environment_but_not_where_episodes_run(data: Path) -> None:
    base = task_digest(settings(data))
    # How many workers host episodes and score turns says nothing about a reward.
    assert task_digest(settings(data, num_workers=9)) == base
    assert task_digest(settings(data, python="/opt/envs/bin/python")) == base
    assert task_digest(settings(data, {"num_score_workers": 7})) == base
    # The environment, its limits and the dataset's verifier do.
    assert task_digest(settings(data, entry="tests.envs.tool_classes:Calculator")) != base
    assert task_digest(settings(data, max_turns=3)) != base
    assert task_digest(settings(data, tool_timeout_s=2.0)) != base
    assert task_digest(settings(data, {"reward_style": "signed"})) != base


@pytest.mark.parametrize(
    ("dataset", "error"),
    [
        ({"template": "plain"}, "needs template 'chat'"),
        ({"system_prompt": "Be brief."}, "takes no system_prompt"),
    ],
)
def test_settings_an_episode_cannot_honour_are_refused(data: Path, dataset: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        settings(data, dataset)


def test_length_control_is_taken_for_the_episode_s_thinking(data: Path) -> None:
    s = settings(data, {"length_control": {"thinking_budget_tokens": [4, 8]}})
    assert s.dataset.length_control.thinking_budget_tokens == (4, 8)


def test_the_broker_issues_train_and_eval_tasks_with_the_digest(data: Path) -> None:
    config = BrokerConfig(task=settings(data), batch_prompts=4)
    recorder = Recorder()
    pipeline = BrokerPipeline(config, recorder, Names(), recorder, None, BrokerMetrics())  # type: ignore[arg-type]
    pipeline.curriculum = Curriculum(pipeline._train, config.seed, config.pass_rate_retire)
    train = [pipeline._train_task(*pipeline.curriculum.next()) for _ in range(8)]
    by_id = {r["id"]: r for r in ROWS}
    assert {t.task_name for t in train} == {"multiturn"}
    assert all(t.task_digest == task_digest(config.task) for t in train)
    # The problem's own text and answer: the generator fills in the prompt format.
    assert all((t.prompt, t.reference) == (by_id[t.prompt_id]["prompt"], by_id[t.prompt_id]["answer"]) for t in train)
    asyncio.run(pipeline.issue_eval_round(0))
    heldout = {p.prompt_id for p in pipeline.task.problems("heldout")}
    assert {t.prompt_id for t in recorder.published} == heldout
    assert all(t.task_digest == task_digest(config.task) and t.task_name == "multiturn" for t in recorder.published)


def test_the_largest_group_is_sized_by_the_episodes_limits(data: Path) -> None:
    """Not by sampling.max_tokens, which an episode does not use: its turns and answers fill at most
    max_episode_tokens, after a first prompt of the environment's messages (at most max_observation_bytes)."""
    task = settings(data, max_episode_tokens=1000, max_observation_bytes=2000)
    config = BrokerConfig(task=task, batch_prompts=4, sampling={"group_size": 4, "max_tokens": 8})
    recorder = Recorder()
    pipeline = BrokerPipeline(config, recorder, Names(), recorder, None, BrokerMetrics())  # type: ignore[arg-type]
    longest = max(len(r["prompt"].encode()) for r in ROWS)
    size = pipeline.largest_message()
    assert size.num_bytes == max_group_bytes(4, 1000, longest + 2000)
    assert size.num_bytes > max_group_bytes(4, 8, longest) + 4 * 900 * GROUP_BYTES_PER_TOKEN
    assert "environment.max_episode_tokens" in size.settings
