"""The ledger against a real nats-server: batched writes, what it knows, and the audit across crashes.

The ledger stores each ``record`` call as one ``LedgerBatch`` message and
answers "has this task ended?" from memory where it can be sure, reading the
stream once (from the oldest unknown task's "issued" record) where it cannot.
The crash tests drop a broker's ledger and batcher between a batch's ledger
write and its acks, start fresh ones on the same streams, and check that the
audit counts every task once.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names, ensure_streams
from asymptote.jetstream.publish import Stored
from asymptote.ledger import Ledger, audit, batch_msg_id, read_batches, read_entries, tally
from asymptote.nats_local import NatsServer
from services.broker.batcher import Batcher

Event = rollout_pb2.LedgerEvent
_ids = itertools.count()


@pytest.fixture
async def nc(nats: NatsServer) -> AsyncIterator[NatsClient]:
    client = await _connect(nats)
    yield client
    await client.close()


async def _connect(server: NatsServer) -> NatsClient:
    return await nats.connect(server.url)


async def ledger_on(nc: NatsClient, max_known: int = 200_000) -> tuple[Names, JetStreamContext, Ledger]:
    names = Names(f"ledger{next(_ids)}")
    js = nc.jetstream()
    await ensure_streams(js, names)
    ledger = Ledger(js, names, "broker", max_known=max_known)
    await ledger.catch_up(1)
    return names, js, ledger


async def num_messages(js: JetStreamContext, names: Names) -> int:
    return int((await js.stream_info(names.ledger_stream)).state.messages)


def issued(ledger: Ledger, *task_ids: str) -> list[rollout_pb2.LedgerEntry]:
    return [ledger.entry(t, Event.LEDGER_EVENT_ISSUED) for t in task_ids]


async def test_a_record_call_is_one_message_and_a_repeat_is_stored_once(nc: NatsClient) -> None:
    names, js, ledger = await ledger_on(nc)
    seq = await ledger.record(*issued(ledger, *(f"train-{i}" for i in range(50))))
    assert seq == 1 and await num_messages(js, names) == 1
    trained = [ledger.entry(f"train-{i}", Event.LEDGER_EVENT_TRAINED, batch_id="b1") for i in range(50)]
    assert await ledger.record(*trained) == 2
    # The same action again (new times, same task, event and batch): the same message id, stored once.
    again = [ledger.entry(f"train-{i}", Event.LEDGER_EVENT_TRAINED, batch_id="b1") for i in reversed(range(50))]
    assert batch_msg_id(again) == batch_msg_id(trained)
    assert await ledger.record(*again) == 2
    assert await ledger.record() == 0
    assert await num_messages(js, names) == 2
    assert [seq for seq, _ in [b async for b in read_batches(js, names)]] == [1, 2]
    assert len(await read_entries(js, names)) == 100
    # Another batch is another training: a different id, stored and counted.
    other = [ledger.entry("train-0", Event.LEDGER_EVENT_TRAINED, batch_id="b2")]
    assert batch_msg_id(other) != batch_msg_id(trained[:1])


async def test_the_ledger_knows_what_it_recorded_without_reading(nc: NatsClient) -> None:
    _names, _js, ledger = await ledger_on(nc)
    seq = await ledger.record(*issued(ledger, "train-0", "train-1", "train-2"))
    assert [ledger.known_ended(f"train-{i}") for i in range(3)] == [False, False, False]
    await ledger.record(ledger.entry("train-0", Event.LEDGER_EVENT_TRAINED, batch_id="b1"))
    await ledger.record(
        ledger.entry("train-1", Event.LEDGER_EVENT_FILTERED, "zero_variance"),
        ledger.entry("train-2", Event.LEDGER_EVENT_DUPLICATE, "second copy of a held group"),
    )
    assert await ledger.ended([(f"train-{i}", seq) for i in range(3)]) == [True, True, False]
    # Issued inside what it covers and never seen: nobody issued it.
    assert ledger.known_ended("train-9", seq) is False and ledger.known_ended("train-9") is None
    assert ledger.num_lookups == 0 and ledger.num_scans == 1  # the catch-up only


async def test_a_restarted_ledger_reads_once_for_every_task_it_inherited(nc: NatsClient) -> None:
    names, js, before = await ledger_on(nc)
    await before.record(before.entry("train-old", Event.LEDGER_EVENT_ISSUED))
    tasks = ("train-t", "train-f", "train-open", "train-held")
    seq = await before.record(*issued(before, *tasks))
    await before.record(before.entry("train-t", Event.LEDGER_EVENT_TRAINED, batch_id="b1"))
    await before.record(before.entry("train-t", Event.LEDGER_EVENT_DUPLICATE, "copy of a task that already ended"))
    await before.record(before.entry("train-f", Event.LEDGER_EVENT_FILTERED, "stale"))
    # A second copy of a group still held: its last entry is a duplicate, yet the task is open.
    await before.record(before.entry("train-held", Event.LEDGER_EVENT_DUPLICATE, "second copy of a held group"))

    # Restarted from a state saved after all this: it reads nothing at start.
    after = Ledger(js, names, "broker")
    await after.catch_up(before.last_seq + 1)
    assert after.num_known == 0 and after.known_ended("train-t", seq) is None
    answers = await after.ended([(t, seq) for t in tasks])
    assert dict(zip(tasks, answers)) == {"train-t": True, "train-f": True, "train-open": False, "train-held": False}
    assert after.num_lookups == 4 and after.num_scans == 2
    # Remembered, and everything issued from there on is covered: no further read.
    assert await after.ended([(t, seq) for t in tasks]) == answers
    assert await after.has_ended("train-nobody", seq) is False
    assert after.num_scans == 2
    # A task issued before what it read: one more read, from that task's record.
    assert await after.has_ended("train-old", 1) is False
    assert after.num_scans == 3 and after.known_ended("train-old") is False
    # A task with no sequence (issued by an older broker) is read from the start.
    assert await after.has_ended("train-t", 0) is True


async def test_a_restart_catches_up_on_what_happened_past_the_saved_state(nc: NatsClient) -> None:
    names, js, before = await ledger_on(nc)
    saved = before.last_seq  # the broker saved its cursor here
    await before.record(*issued(before, "train-a", "train-b"))
    await before.record(before.entry("train-a", Event.LEDGER_EVENT_TRAINED, batch_id="b1"))
    # The broker crashed before saving again: the new one re-issues train-a and train-b.
    after = Ledger(js, names, "broker")
    await after.catch_up(saved + 1)
    assert after.known_ended("train-a") is True and after.known_ended("train-b") is False
    # Re-recording "issued" never reopens an outcome.
    await after.record(*issued(after, "train-a", "train-b", "train-c"))
    assert [after.known_ended(t) for t in ("train-a", "train-b", "train-c")] == [True, False, False]


async def test_forgetting_is_only_slower(nc: NatsClient) -> None:
    _names, _js, ledger = await ledger_on(nc, max_known=2)
    seq = await ledger.record(*issued(ledger, "train-s0", "train-s1", "train-s2"))
    await ledger.record(ledger.entry("train-s0", Event.LEDGER_EVENT_FILTERED, "stale"))
    await ledger.record(*issued(ledger, "train-s3", "train-s4"))
    assert ledger.num_known == 2
    # train-s0 was forgotten: memory no longer covers its record, so it is read again.
    assert ledger.known_ended("train-s0", seq) is None
    assert await ledger.has_ended("train-s0", seq) is True and ledger.num_lookups == 1


@dataclass
class FakeMsg:
    """A rollout group's message as the batcher sees it; ``acked`` says whether it left the queue."""

    group_id: str
    acked: bool = False
    calls: list[str] = field(default_factory=list)

    async def ack(self) -> None:
        self.acked = True

    async def nak(self, delay: float | None = None) -> None:
        self.calls.append("nak")

    async def in_progress(self) -> None:
        self.calls.append("in_progress")


def group(task_id: str, issued_seq: int, rewards: tuple[float, ...] = (0.0, 1.0)) -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(
        group_id=task_id,
        task=rollout_pb2.GenerationTask(task_id=task_id, ledger_seq=issued_seq),
        prompt_token_ids=[1, 2],
        completions=[
            rollout_pb2.Completion(
                token_ids=[3],
                logprobs=[-0.1],
                reward=r,
                version_spans=[rollout_pb2.VersionSpan(version=0, start=0, end=1)],
            )
            for r in rewards
        ],
    )


async def test_a_crash_between_the_trained_batch_and_its_acks_trains_nothing_twice(nc: NatsClient) -> None:
    names, js, ledger = await ledger_on(nc)
    task_ids = [f"train-c{i}" for i in range(6)]
    seq = await ledger.record(*issued(ledger, *task_ids))
    batcher = Batcher(4, 8, ledger, zero_variance="refill")
    msgs = {t: FakeMsg(t) for t in task_ids}
    flat = task_ids[5]
    reasons = await batcher.admit_all(
        [(group(t, seq, (1.0, 1.0) if t == flat else (0.0, 1.0)), msgs[t], False) for t in task_ids]
    )
    assert reasons == [None] * 5 + ["zero_variance"] and msgs[flat].acked
    batch = await batcher.next_batch(0, 4, timeout_s=1.0)
    assert batch is not None

    # The broker stores the batch's "trained" record, then dies before acking a message.
    entries = [ledger.entry(h.group.group_id, Event.LEDGER_EVENT_TRAINED, batch_id=batch.batch_id) for h in batch.items]
    await ledger.record(*entries)
    trained = [h.group.group_id for h in batch.items]
    assert not any(msgs[t].acked for t in trained)
    # Nothing is lost meanwhile: the audit sees the unacked groups as trained, the fifth in flight.
    midway = tally(await read_entries(js, names), queued={task_ids[4]})
    assert (midway.trained, midway.in_flight, midway.lost, midway.trained_twice) == (4, 1, [], [])

    # A new broker: catches up from its saved state (before all of this), and JetStream
    # redelivers every unacked message to it.
    restarted = Ledger(js, names, "broker")
    await restarted.catch_up(seq + 1)
    again = Batcher(4, 8, restarted)
    redelivered = {t: FakeMsg(t) for t in [*trained, task_ids[4]]}
    answers = await restarted.ended([(t, seq) for t in redelivered])
    assert answers == [True] * 4 + [False]
    reasons = await again.admit_all([(group(t, seq), redelivered[t], e) for t, e in zip(redelivered, answers)])
    assert reasons == ["duplicate"] * 4 + [None]
    assert all(redelivered[t].acked for t in trained) and not redelivered[task_ids[4]].acked

    # The learner acks the same batch again (it does not know the broker restarted): recorded
    # under the same batch id, so nothing counts twice.
    num, unknown = await again.ack([(batch.batch_id, trained, ())])
    assert (num, unknown) == (0, [batch.batch_id])
    result = tally(await read_entries(js, names), queued={task_ids[4]})
    assert result.ok and (result.trained, result.in_flight, result.duplicates_caught) == (4, 1, 4)
    assert result.filtered == {"zero_variance": 1} and result.trained_twice == [] and result.lost == []


async def test_groups_trained_before_a_stop_whose_ack_never_arrived_are_recorded_trained(nc: NatsClient) -> None:
    """The whole run stops at once: the learner checkpoints a batch, but the broker is gone before its ack.
    After the restart the batch is redelivered and the learner, whose checkpoint holds those groups, acks
    them as already trained: the ledger records them trained (its first outcome for them), none lost."""
    names, js, ledger = await ledger_on(nc)
    task_ids = [f"train-s{i}" for i in range(4)]
    seq = await ledger.record(*issued(ledger, *task_ids))
    batcher = Batcher(4, 8, ledger)
    await batcher.admit_all([(group(t, seq), FakeMsg(t), False) for t in task_ids])
    batch = await batcher.next_batch(0, 4, timeout_s=1.0)
    assert batch is not None  # handed out and trained; the ack never arrives
    stopped = tally(await read_entries(js, names), queued=set(task_ids))
    assert (stopped.trained, stopped.in_flight, stopped.lost) == (0, 4, [])

    restarted = Ledger(js, names, "broker")
    await restarted.catch_up(seq + 1)
    again = Batcher(4, 8, restarted)
    redelivered = {t: FakeMsg(t) for t in task_ids}
    assert await again.admit_all([(group(t, seq), redelivered[t], False) for t in task_ids]) == [None] * 4
    second = await again.next_batch(0, 4, timeout_s=1.0)
    assert second is not None
    # The learner's trained ids hold every group: it skips them all and says so.
    num, unknown = await again.ack([(second.batch_id, task_ids, task_ids)])
    assert (num, unknown) == (4, []) and all(m.acked for m in redelivered.values())
    result = tally(await read_entries(js, names), queued=set())
    assert result.ok and (result.trained, result.duplicates_caught, result.lost, result.trained_twice) == (4, 0, [], [])
    # A copy acked as a duplicate after that is one: the outcome is not recorded twice.
    third = Batcher(4, 8, restarted)
    late = {t: FakeMsg(t) for t in task_ids}
    await third.admit_all([(group(t, seq), late[t], False) for t in task_ids])
    again_batch = await third.next_batch(0, 4, timeout_s=1.0)
    assert again_batch is not None
    await third.ack([(again_batch.batch_id, task_ids, task_ids)])
    final = tally(await read_entries(js, names), queued=set())
    assert (final.trained, final.duplicates_caught, final.trained_twice) == (4, 4, [])


async def test_a_failed_ledger_write_acks_nothing(nc: NatsClient, monkeypatch: pytest.MonkeyPatch) -> None:
    names, js, ledger = await ledger_on(nc)
    seq = await ledger.record(*issued(ledger, "train-x", "train-y"))
    batcher = Batcher(1, 0, ledger)
    await batcher.set_learner_version(5)  # both groups arrive stale
    msgs = [FakeMsg("train-x"), FakeMsg("train-y")]
    with monkeypatch.context() as m:
        m.setattr(ledger.publisher, "publish_all", failing_publish)
        with pytest.raises(NatsTimeoutError):
            await batcher.admit_all([(group(msg.group_id, seq), msg, False) for msg in msgs])
    assert not any(msg.acked for msg in msgs)  # JetStream redelivers them, and they are recorded then
    await batcher.admit_all([(group(msg.group_id, seq), msg, False) for msg in msgs])
    assert all(msg.acked for msg in msgs)
    result = await audit(js, names)
    assert result.ok and result.filtered == {"stale": 2} and result.lost == []


async def failing_publish(*args: object, **kwargs: object) -> list[Stored]:
    raise NatsTimeoutError()
