"""DAPO's soft overlong punishment against a plain reference at the boundary lengths; what a truncated
completion earns."""

from __future__ import annotations

import pytest

from asymptote.contracts.v1 import rollout_pb2
from services.broker.config import SamplingSettings
from services.broker.shaping import overlong_penalty, score_truncated, shape_overlong


def reference(length: int, l_max: int, l_cache: int) -> float:
    """DAPO eq. 13, written out case by case."""
    if length <= l_max - l_cache:
        return 0.0
    elif l_max - l_cache < length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    else:
        return -1.0


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (12, 0.0),  # L_max - L_cache: the last length without a penalty
        (13, -0.25),  # the first penalised length
        (14, -0.5),
        (15, -0.75),
        (16, -1.0),  # L_max itself
        (17, -1.0),  # beyond L_max
        (100, -1.0),
    ],
)
def test_penalty_at_the_boundaries(length: int, expected: float) -> None:
    assert overlong_penalty(length, 16, 4) == pytest.approx(expected, abs=1e-12)
    assert overlong_penalty(length, 16, 4) == pytest.approx(reference(length, 16, 4), abs=1e-12)


def test_penalty_matches_the_reference_over_every_length() -> None:
    for l_max, l_cache in [(16, 4), (16, 16), (7, 1), (4096, 512)]:
        for length in range(l_max + 3):
            assert overlong_penalty(length, l_max, l_cache) == pytest.approx(reference(length, l_max, l_cache))


def test_shaping_adds_the_penalty_to_each_reward() -> None:
    group = rollout_pb2.RolloutGroup(
        completions=[
            rollout_pb2.Completion(token_ids=list(range(n)), reward=r) for n, r in [(5, 1.0), (13, 1.0), (16, 0.0)]
        ]
    )
    shape_overlong(group, max_tokens=16, cache_tokens=4)
    assert [c.reward for c in group.completions] == pytest.approx([1.0, 0.75, -1.0])


def test_cache_longer_than_the_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="overlong_cache_tokens"):
        SamplingSettings(max_tokens=8, overlong_cache_tokens=9)
    assert SamplingSettings(max_tokens=8, overlong_cache_tokens=8).overlong_cache_tokens == 8


def test_a_truncated_completion_earns_the_truncated_reward_whatever_its_verifier_said() -> None:
    group = rollout_pb2.RolloutGroup(
        completions=[
            rollout_pb2.Completion(token_ids=list(range(n)), reward=r, truncated=cut)
            for n, r, cut in [(5, 1.0, False), (16, 1.0, True), (16, 0.0, True), (9, 0.0, False)]
        ]
    )
    assert score_truncated(group, 0.0)
    assert [c.reward for c in group.completions] == [1.0, 0.0, 0.0, 0.0]
    shape_overlong(group, max_tokens=16, cache_tokens=4)  # the pipeline's order: then the length penalty
    assert [c.reward for c in group.completions] == pytest.approx([1.0, -1.0, -1.0, 0.0])
    untouched = rollout_pb2.RolloutGroup(completions=[rollout_pb2.Completion(token_ids=[1], reward=1.0)])
    assert not score_truncated(untouched, 0.0) and untouched.completions[0].reward == 1.0
    assert SamplingSettings().truncated_reward == 0.0
