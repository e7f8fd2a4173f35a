"""Two runs under different prefixes share one nats-server and never see each other's messages.

Two real brokers, prefixes ``lab_a`` and ``lab_b`` (what the chart makes
of releases ``lab-a`` and ``lab-b``), run at once on the session's server.
The test plays each run's generators and learner (as test_broker_nats
does): it leases each run's tasks, publishes their groups, takes two
batches and acks them. Each run's ledger then holds only its own tasks,
every one trained once or still in flight: 0 lost, 0 twice.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

from test_broker_nats import Harness, lease, make_group, next_batch, publish_group, running

from asymptote.contracts.v1 import rollout_pb2, services_pb2
from asymptote.jetstream.names import Names
from asymptote.ledger import audit, read_entries
from asymptote.nats_local import NatsServer

BATCHES = 2


def harness(nats: NatsServer, prefix: str, max_digits: int) -> Harness:
    """A run under ``prefix`` whose prompts (and so task ids) are its own: sums of up to ``max_digits``."""
    h = Harness(nats)
    h.prefix, h.names = prefix, Names(prefix)
    task = h.config.task.model_copy(update={"max_digits": max_digits})
    h.config = h.config.model_copy(update={"prefix": prefix, "task": task})
    return h


async def train_batches(h: Harness, num: int) -> list[str]:
    """Play generators and the learner for ``num`` batches; the ids of the groups trained."""
    trained: list[str] = []
    for _ in range(num):
        leased: list[tuple[rollout_pb2.GenerationTask, object]] = []
        while len(leased) < 2:  # one at a time: the broker issues the next batch's as this one trains
            got = await lease(h, 1)
            assert got, f"{h.prefix}: no task to lease"
            leased += [(t, m) for t, m in got if t.kind == rollout_pb2.TASK_KIND_TRAIN]
        for t, m in leased:
            assert not await publish_group(h, make_group(t, [1.0, 0.0]))
            await m.ack()  # type: ignore[attr-defined]
        header, groups = await next_batch(h)
        assert header.num_groups == 2
        await h.stub.Ack(services_pb2.AckRequest(batch_ids=[header.batch_id]))
        trained += [g.group_id for g in groups]
    return trained


async def test_two_prefixes_on_one_server_keep_their_tasks_and_ledgers_apart(nats: NatsServer) -> None:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(running(harness(nats, "lab_a", max_digits=2)))
        b = await stack.enter_async_context(running(harness(nats, "lab_b", max_digits=3)))
        trained = {h.prefix: await train_batches(h, BATCHES) for h in (a, b)}
        for h in (a, b):
            other = b if h is a else a
            result = await audit(h.js, h.names)
            print(h.prefix, {k: v for k, v in result.as_dict().items() if k != "examples"})
            assert result.ok, result.as_dict()
            assert result.trained == 2 * BATCHES == len(set(trained[h.prefix]))
            assert result.lost == [] and result.trained_twice == [] and result.ended_twice == []
            assert result.issued == result.trained + result.in_flight
            # Only its own: no task of the other run is in this run's ledger, or trained here.
            ours = {e.task_id for e in await read_entries(h.js, h.names)}
            theirs = {e.task_id for e in await read_entries(other.js, other.names)}
            assert set(trained[h.prefix]) <= ours and ours.isdisjoint(theirs)
        streams = {s.config.name for s in await a.js.streams_info()}
        assert {"LAB_A_TASKS", "LAB_A_LEDGER", "LAB_B_TASKS", "LAB_B_LEDGER"} <= streams
