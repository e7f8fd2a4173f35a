"""The broker's shortcuts through protobuf's wire format agree with protobuf.

The log-probs of a group are checked on the wire (one numpy pass over the
packed float32 bytes) and fall back to the per-completion check whenever
the bytes do not hold them whole; NextBatch frames the stored group bytes
by hand, and the learner must parse exactly the parts protobuf would build.
"""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymptote.contracts.v1 import rollout_pb2, services_pb2
from asymptote.errors import PayloadError
from asymptote.messages import decode_group, logprobs_in_range
from asymptote.wire import length_delimited, length_delimited_key, varint
from services.broker.server import group_frames

# float32 values, with the ones the check must refuse.
logprob = st.one_of(
    st.floats(width=32, max_value=0.0, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1e-30, 0.5, math.inf, -math.inf, math.nan]),
)


def group_of(logprobs: list[list[float]]) -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(
        group_id="g",
        prompt_token_ids=[1, 2],
        completions=[
            rollout_pb2.Completion(token_ids=[3] * len(lp), logprobs=lp, reward=float(i % 2))
            for i, lp in enumerate(logprobs)
        ],
    )


def slow_check(group: rollout_pb2.RolloutGroup) -> bool:
    return all(math.isfinite(x) and x <= 0.0 for c in group.completions for x in c.logprobs)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(logprob, min_size=1, max_size=40), min_size=1, max_size=8))
def test_the_wire_check_agrees_with_one_float_at_a_time(logprobs: list[list[float]]) -> None:
    g = group_of(logprobs)
    assert logprobs_in_range(g, g.SerializeToString()) == slow_check(g)


def unpacked(g: rollout_pb2.RolloutGroup, completion: int) -> bytes:
    """``g`` serialized with one completion's log-probs written unpacked (one fixed32 field per value)."""
    parts = []
    for i, c in enumerate(g.completions):
        if i != completion:
            parts.append(length_delimited(length_delimited_key(4), c.SerializeToString()))
            continue
        rest = rollout_pb2.Completion()
        rest.CopyFrom(c)
        del rest.logprobs[:]
        body = rest.SerializeToString() + b"".join(varint(2 << 3 | 5) + struct.pack("<f", x) for x in c.logprobs)
        parts.append(length_delimited(length_delimited_key(4), body))
    head = rollout_pb2.RolloutGroup(group_id=g.group_id, prompt_token_ids=g.prompt_token_ids)
    return head.SerializeToString() + b"".join(parts)


def test_log_probs_written_unpacked_are_checked_one_completion_at_a_time() -> None:
    good = group_of([[-0.5, -1.0], [-0.25, -2.0, -3.0]])
    data = unpacked(good, completion=1)
    parsed = decode_group(data)  # a legal encoding: accepted
    assert list(parsed.completions[1].logprobs) == [-0.25, -2.0, -3.0]
    assert not logprobs_in_range(parsed, data)  # the view cannot see them: the slow path decided

    bad = group_of([[-0.5, -1.0], [-0.25, 0.5, -3.0]])
    with pytest.raises(PayloadError, match="completion 1: logprobs must be finite and <= 0"):
        decode_group(unpacked(bad, completion=1))


def test_log_probs_split_over_two_packed_runs_are_not_taken_from_the_last_run_alone() -> None:
    # Two packed runs of one field concatenate on parsing; a bytes view keeps only the last.
    first = rollout_pb2.Completion(token_ids=[3, 3, 3, 3], logprobs=[0.5, -1.0])  # the bad value is in run one
    second = rollout_pb2.Completion(logprobs=[-1.0, -1.0])
    body = first.SerializeToString() + second.SerializeToString()
    data = rollout_pb2.RolloutGroup(group_id="g", prompt_token_ids=[1]).SerializeToString() + length_delimited(
        length_delimited_key(4), body
    )
    g = rollout_pb2.RolloutGroup.FromString(data)
    assert list(g.completions[0].logprobs) == [0.5, -1.0, -1.0, -1.0]
    assert not logprobs_in_range(g, data)


def parsed_groups(frames: list[bytes]) -> list[rollout_pb2.RolloutGroup]:
    out: list[rollout_pb2.RolloutGroup] = []
    for frame in frames:
        part = services_pb2.BatchPart.FromString(frame)
        kind = part.WhichOneof("part")
        out += list(part.groups.groups) if kind == "groups" else [part.group]
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=30), st.booleans())
def test_frames_carry_the_groups_in_order_as_protobuf_would(num_tokens: list[int], packed: bool) -> None:
    groups = [
        rollout_pb2.RolloutGroup(
            group_id=f"g{i}",
            prompt_token_ids=[1],
            completions=[rollout_pb2.Completion(token_ids=[5] * n, logprobs=[-0.5] * n, reward=1.0)],
        )
        for i, n in enumerate(num_tokens)
    ]
    limit = 2_000
    frames = list(group_frames([g.SerializeToString() for g in groups], packed, part_bytes=limit))
    assert parsed_groups(frames) == groups
    if not packed:
        assert len(frames) == len(groups)
        return
    expected = services_pb2.BatchPart(groups=services_pb2.RolloutGroups(groups=groups[:1])).SerializeToString()
    sizes = [len(services_pb2.BatchPart.FromString(f).groups.groups) for f in frames]
    if sizes[0] == 1:
        assert frames[0] == expected  # byte for byte where protobuf orders the fields the same
    for frame, size in zip(frames, sizes, strict=True):
        body = services_pb2.BatchPart.FromString(frame).groups.ByteSize()
        assert body <= limit or size == 1  # a part over the limit holds one group that is larger alone
    # Parts are as full as the limit allows: the next part's first group would not have fitted.
    start = 0
    for size in sizes[:-1]:
        grown = services_pb2.RolloutGroups(groups=groups[start : start + size + 1]).ByteSize()
        assert grown > limit
        start += size
