"""The learner's NextBatch client against a broker answering with bad bytes (real gRPC).

Whatever the broker's reply holds, the client returns a whole batch, None
(nothing to train), or raises PayloadError naming the problem, which the
learner's loop logs and survives; it never trains a partial batch.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from asymptote.contracts.v1 import rollout_pb2, services_pb2
from asymptote.errors import PayloadError
from asymptote.health import Health
from services.learner.loop import BrokerClient
from tests.helpers.badinput import BAD_INPUTS, corrupted, raw_stream_server

INTERFACE = "gRPC Broker replies (learner)"


def part(**kwargs: object) -> bytes:
    return services_pb2.BatchPart(**kwargs).SerializeToString()


def group(i: int) -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(
        group_id=f"g{i}", completions=[rollout_pb2.Completion(token_ids=[1, 2], reward=1.0)]
    )


HEADER = services_pb2.BatchHeader(batch_id="b1", num_groups=2)
GOOD = [part(header=HEADER), part(groups=services_pb2.RolloutGroups(groups=[group(0), group(1)]))]


def raw_broker(replies: Callable[[], list[bytes]]) -> AbstractAsyncContextManager[str]:
    """A Broker.NextBatch server sending the frames ``replies()`` gives each call; yields its endpoint."""

    async def stream() -> AsyncIterator[bytes]:
        for frame in replies():
            yield frame

    return raw_stream_server("Broker", "NextBatch", stream)


async def test_bad_replies_are_refused_and_a_good_one_is_taken_after() -> None:
    rng = random.Random(5)
    bad: list[list[bytes]] = [
        [b"\xff\xff\xff"],  # not a BatchPart at all
        [GOOD[0], b"\x12\xff\xff\xff\xff\x0f"],  # a header, then bytes that do not parse
        [GOOD[0], part(groups=services_pb2.RolloutGroups(groups=[group(0)]))],  # one group short of the header
        [GOOD[0], *GOOD[1:], part(group=group(2))],  # one group too many
    ]
    bad += [[GOOD[0], frame] for frame in corrupted(rng, GOOD[1], 40)]
    queue = [*bad, GOOD]
    health = Health("learner")
    async with raw_broker(lambda: queue.pop(0)) as endpoint:
        client = BrokerClient(endpoint, health)
        try:
            outcomes = {"refused": 0, "whole": 0, "empty": 0}
            for frames in bad:
                with BAD_INPUTS.trying(INTERFACE, frames):
                    try:
                        got = await client.next_batch(1, 2, 1.0)
                    except PayloadError as exc:
                        assert "BatchPart" in str(exc) or "groups" in str(exc), exc
                        outcomes["refused"] += 1
                        continue
                if got is None:
                    outcomes["empty"] += 1
                    continue
                # A corruption that still parses: the batch is whole or it is refused, never partial.
                header, groups = got
                assert len(groups) == header.num_groups
                outcomes["whole"] += 1
            assert outcomes["refused"] >= 4, outcomes
            header, groups = await client.next_batch(1, 2, 1.0)  # the broker's next good reply
            assert header.batch_id == "b1" and [g.group_id for g in groups] == ["g0", "g1"]
            assert "broker" not in health.detail  # the broker answered every call: never marked unreachable
        finally:
            await client.close()
    assert BAD_INPUTS.num_tried(INTERFACE) >= len(bad) - 3  # a corruption may repeat another
