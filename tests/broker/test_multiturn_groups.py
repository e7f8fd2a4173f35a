"""The broker and multi-turn groups: sequences with prompts of their own, episodes split in sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import PayloadError
from asymptote.messages import decode_group
from services.broker.batcher import is_zero_variance, pass_rate
from services.broker.config import BrokerConfig


def sequence(
    tokens: list[int],
    reward: float,
    prompt: list[int] | None = None,
    continues: bool = False,
    mask: list[int] | None = None,
    spans: list[tuple[int, int, int]] | None = None,
) -> rollout_pb2.Completion:
    return rollout_pb2.Completion(
        token_ids=tokens,
        logprobs=[0.0 if mask and not m else -0.5 for m in (mask or [1] * len(tokens))],
        loss_mask=mask or [],
        version_spans=[rollout_pb2.VersionSpan(version=v, start=a, end=b) for v, a, b in spans or []],
        reward=reward,
        prompt_token_ids=prompt,
        continues_episode=continues,
    )


def group(prompt: list[int], *completions: rollout_pb2.Completion) -> bytes:
    return rollout_pb2.RolloutGroup(
        group_id="t-1", prompt_token_ids=prompt, completions=list(completions)
    ).SerializeToString()


def test_sequences_with_their_own_prompts_and_continued_episodes_are_taken() -> None:
    data = group(
        [1, 2, 3],
        # turn, two environment tokens (out of the loss, no span), turn
        sequence([4, 5, 6, 7, 8], 1.0, mask=[1, 1, 0, 0, 1], spans=[(3, 0, 2), (4, 4, 5)]),
        sequence([9], 1.0, prompt=[1, 2, 3, 4, 5, 6, 7], continues=True, spans=[(4, 0, 1)]),
        sequence([10, 11], 0.0, spans=[(4, 0, 2)]),
    )
    taken = decode_group(data)
    assert [list(c.prompt_token_ids) for c in taken.completions] == [[], [1, 2, 3, 4, 5, 6, 7], []]
    assert [c.continues_episode for c in taken.completions] == [False, True, False]


def test_a_group_without_its_own_prompt_is_taken_when_every_sequence_has_one() -> None:
    decode_group(group([], sequence([4], 1.0, prompt=[1, 2]), sequence([5], 0.0, prompt=[1, 3])))


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (
            group([], sequence([4], 1.0, prompt=[1, 2]), sequence([5], 0.0)),
            "completion 1: no prompt tokens",
        ),
        (group([1], sequence([4], 1.0, continues=True)), "completion 0: continues an episode, but it is the first"),
        (
            group([1], sequence([4], 1.0), sequence([5], 0.0, prompt=[1, 4], continues=True)),
            "completion 1: continues an episode, but its reward 0.0 is not the episode's",
        ),
        (
            # An environment token inside a version span's gap is fine; a model token uncovered is not.
            group([1], sequence([4, 5, 6], 1.0, mask=[1, 0, 1], spans=[(3, 0, 1)])),
            "version spans cover 1 of 3 tokens",
        ),
    ],
)
def test_malformed_multiturn_groups_are_refused(data: bytes, error: str) -> None:
    with pytest.raises(PayloadError, match=error):
        decode_group(data)


def test_a_groups_pass_rate_counts_episodes_not_sequences() -> None:
    """Two episodes, the passing one in three sequences: half the episodes pass (not three of four sequences)."""
    data = group(
        [1],
        sequence([4], 1.0),
        sequence([5], 1.0, prompt=[1, 4, 9], continues=True),
        sequence([6], 1.0, prompt=[1, 4, 9, 5, 9], continues=True),
        sequence([7], 0.0),
    )
    assert pass_rate(decode_group(data)) == 0.5
    assert not is_zero_variance(decode_group(data))


def test_overlong_shaping_is_refused_for_a_multiturn_task(tmp_path: Path) -> None:
    task = {"name": "multiturn", "dataset": {"path": str(tmp_path / "x.jsonl"), "holdout_fraction": 0.1}}
    task["environment"] = {"entry": "tests.envs.tool_classes:Counter"}
    with pytest.raises(ValidationError, match=r"overlong_cache_tokens .* a multi-turn episode does not use"):
        BrokerConfig(task=task, sampling={"max_tokens": 16, "overlong_cache_tokens": 4})
    BrokerConfig(task=task, sampling={"max_tokens": 16})
