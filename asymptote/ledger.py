"""The ledger: what became of every issued train task, and its audit.

Owns recording ``LedgerEntry`` events, in ``LedgerBatch`` messages on
``<prefix>.ledger.entries`` (a file-backed JetStream stream that nothing
consumes away), and auditing them
against what the work-queue streams still hold. An issued task is, at any
moment, exactly one of: trained (its group is in a durable learner
checkpoint), filtered with a reason, dead-lettered, or in flight (its task
or its rollout group still sits in a work queue). The audit names every
task that is none of these (lost) and every task trained more than once.

Message ids make re-recording idempotent (a service that crashes and
repeats an action records it once), while a second training in another
batch carries another batch id and is counted, not hidden. Which write
protects which guarantee is told in docs/architecture.md ("Nothing lost").
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names
from asymptote.jetstream.publish import Outgoing, Publisher
from asymptote.messages import decode_ledger_batch

log = logging.getLogger(__name__)

TRAIN_TASK_PREFIX = "train-"
"""Train task ids (and so rollout group ids) start with this; other message ids are no issued task's."""


class Event:
    """The ledger's events (``LedgerEvent``) as the module's plain ints: reading a value off the
    protobuf enum's wrapper calls its ``__getattr__`` (2.5 us), and the broker does it per group."""

    LEDGER_EVENT_UNSPECIFIED = rollout_pb2.LEDGER_EVENT_UNSPECIFIED
    LEDGER_EVENT_ISSUED = rollout_pb2.LEDGER_EVENT_ISSUED
    LEDGER_EVENT_TRAINED = rollout_pb2.LEDGER_EVENT_TRAINED
    LEDGER_EVENT_FILTERED = rollout_pb2.LEDGER_EVENT_FILTERED
    LEDGER_EVENT_DEADLETTERED = rollout_pb2.LEDGER_EVENT_DEADLETTERED
    LEDGER_EVENT_DUPLICATE = rollout_pb2.LEDGER_EVENT_DUPLICATE


TERMINAL = frozenset((Event.LEDGER_EVENT_TRAINED, Event.LEDGER_EVENT_FILTERED, Event.LEDGER_EVENT_DEADLETTERED))


def batch_msg_id(entries: Sequence[rollout_pb2.LedgerEntry]) -> str:
    """The deduplication id of a batch: a digest of its entries' (task, event, batch) keys.

    A repeated action (the same entries recorded again after a failure or a
    restart) is stored once, whatever the entries' times; a second training
    in another batch has another batch id and another key, so it is stored
    and counted, never hidden.
    """
    keys = "\n".join(sorted(f"{e.task_id}:{e.event}:{e.batch_id}" for e in entries))
    return f"ledger-{len(entries)}-{hashlib.blake2b(keys.encode(), digest_size=16).hexdigest()}"


class Ledger:
    """Records events for one service, and answers whether a task has ended.

    Writes are batched: one ``record`` call stores its entries as one
    ``LedgerBatch`` message (whole or not at all), so a chunk of issued tasks,
    a learner's Ack or a fetch's drops cost one durable write, not one per
    task. The caller acks or publishes what a batch covers only after
    ``record`` returned.

    Whether a task has ended is answered from memory where this ledger can
    be sure. It folds every entry it records, and every entry it reads, into
    ``_ended``; ``_covered_from`` is a ledger sequence from which on it has
    folded every entry (its own and what it read). A task's records all
    come at or after its "issued" record, whose sequence travels in the task
    (``GenerationTask.ledger_seq``), so a task issued inside the covered
    range and absent from memory was never issued. Anything older is read
    once from the stream, from the oldest such task's sequence to the end,
    which extends the covered range back. The broker is the only writer of
    outcomes (one replica, or one per partition of task ids), which is what
    makes its own records the truth for the tasks it handles. (A generator
    also records, for a train task it refuses on arrival, that the task was
    dead-lettered; such a task never comes back to the broker as a group.)

    A fresh "issued" this ledger records marks its task open only after
    :meth:`catch_up` read the ledger from the broker's last saved state: a
    task re-issued after a restart may have ended under the previous broker,
    and those events are then in memory.
    """

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        service: str,
        publisher: Publisher | None = None,
        max_known: int = 200_000,
    ) -> None:
        self.js = js
        self.names = names
        self.service = service
        self.publisher = publisher or Publisher(js)
        self.max_known = max_known
        self._ended: OrderedDict[str, bool] = OrderedDict()
        """Whether a task has an outcome, for the tasks this ledger recorded or read (oldest first)."""
        self._covered_from: int | None = None
        """Every entry at or after this ledger sequence is folded into ``_ended`` (None: no such claim)."""
        self._forgot_through = 0
        """The newest sequence folded when ``_ended`` last forgot a task: coverage starts after it."""
        self._issue_marks_open = False
        """Whether a fresh "issued" record marks its task open (after :meth:`catch_up`)."""
        self.last_seq = 0
        """The newest ledger sequence this ledger stored or read."""
        self.num_lookups = 0
        """Tasks whose state had to be read from the stream (not known here)."""
        self.num_scans = 0
        """Reads of the stream those lookups and catch-ups took."""

    def entry(
        self,
        task_id: str,
        event: rollout_pb2.LedgerEvent,
        reason: str = "",
        policy_version: int = 0,
        batch_id: str = "",
    ) -> rollout_pb2.LedgerEntry:
        return rollout_pb2.LedgerEntry(
            task_id=task_id,
            event=event,
            reason=reason[:512],
            policy_version=policy_version,
            batch_id=batch_id,
            unix_s=time.time(),
            service=self.service,
        )

    async def record(self, *entries: rollout_pb2.LedgerEntry) -> int:
        """Store ``entries`` (made by :meth:`entry`) as one message; returns its ledger sequence
        (0 for no entries) once stored, else raises (see Publisher.publish_all)."""
        if not entries:
            return 0
        batch = rollout_pb2.LedgerBatch(entries=entries)
        (stored,) = await self.publisher.publish_all(
            [Outgoing(self.names.ledger_entries, batch.SerializeToString(), batch_msg_id(entries))]
        )
        self._fold(entries, stored.seq, fresh=self._issue_marks_open and not stored.duplicate)
        return stored.seq

    def _fold(self, entries: Sequence[rollout_pb2.LedgerEntry], seq: int, fresh: bool) -> None:
        """Take ``entries``, stored at ``seq``, into memory.

        ``fresh``: an "issued" record marks its task open (nothing can have
        come before it that is not in memory already). Any other record that
        is not an outcome (a duplicate caught) says nothing new.
        """
        self.last_seq = max(self.last_seq, seq)
        for e in entries:
            if e.event in TERMINAL:
                # Once ended, always ended: an outcome is never reopened.
                self._ended[e.task_id] = True
            elif fresh and e.event == Event.LEDGER_EVENT_ISSUED:
                self._ended.setdefault(e.task_id, False)
            elif e.task_id not in self._ended:
                continue
            self._ended.move_to_end(e.task_id)
        while len(self._ended) > self.max_known:
            self._ended.popitem(last=False)
            self._forgot_through = self.last_seq

    @property
    def num_known(self) -> int:
        """Tasks whose state is in memory."""
        return len(self._ended)

    def _covered(self, issued_seq: int) -> bool:
        """Whether every record of a task issued at ``issued_seq`` is in memory."""
        return (
            self._covered_from is not None
            and issued_seq > 0
            and issued_seq >= max(self._covered_from, self._forgot_through + 1)
        )

    def known_ended(self, task_id: str, issued_seq: int = 0) -> bool | None:
        """Whether the task has an outcome, if this ledger knows without reading; None if not.

        ``issued_seq``: the sequence of the task's "issued" record (from the
        task), which lets a task absent from memory be answered.
        """
        known = self._ended.get(task_id)
        if known is not None:
            return known
        return False if self._covered(issued_seq) else None

    async def ended(self, tasks: Sequence[tuple[str, int]]) -> list[bool]:
        """Whether each (task id, sequence of its "issued" record) has an outcome; reads the stream
        once for all the tasks memory does not answer (sequence 0: from the start)."""
        answers = [self.known_ended(task_id, seq) for task_id, seq in tasks]
        unknown = [i for i, a in enumerate(answers) if a is None]
        if unknown:
            self.num_lookups += len(unknown)
            wanted = {tasks[i][0] for i in unknown}
            found = await self._scan(max(1, min(tasks[i][1] for i in unknown)), wanted)
            for i in unknown:
                answers[i] = found.get(tasks[i][0], False)
        return [bool(a) for a in answers]

    async def has_ended(self, task_id: str, issued_seq: int = 0) -> bool:
        """Whether the task already has an outcome (trained, filtered, dead-lettered)."""
        return (await self.ended([(task_id, issued_seq)]))[0]

    async def catch_up(self, from_seq: int) -> None:
        """Read every entry from ``from_seq`` on; from then, a fresh "issued" record marks its task open.

        The broker calls it at start with the sequence after the one its
        saved state names, before it issues anything.
        """
        await self._scan(max(1, from_seq), set())
        self._issue_marks_open = True

    async def _scan(self, from_seq: int, wanted: set[str]) -> dict[str, bool]:
        """Fold every entry from ``from_seq`` to the end; the state of each ``wanted`` task seen."""
        self.num_scans += 1
        found: dict[str, bool] = {}
        async for seq, batch in read_batches(self.js, self.names, from_seq):
            for e in batch.entries:
                if e.task_id in wanted:
                    found[e.task_id] = found.get(e.task_id, False) or e.event in TERMINAL
            self._fold(batch.entries, seq, fresh=True)
        if self._covered_from is None or from_seq < self._covered_from:
            # Forgetting while reading leaves coverage to start after it (``_forgot_through``).
            self._covered_from = from_seq
        return found


@dataclass
class Audit:
    """The state of every issued train task at the time of the audit."""

    issued: int = 0
    trained: int = 0
    filtered: dict[str, int] = field(default_factory=dict)
    deadlettered: int = 0
    in_flight: int = 0
    duplicates_caught: int = 0
    lost: list[str] = field(default_factory=list)
    trained_twice: list[str] = field(default_factory=list)
    ended_twice: list[str] = field(default_factory=list)
    never_issued: list[str] = field(default_factory=list)
    deadlettered_unissued: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.trained_twice or self.ended_twice or self.never_issued)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "issued": self.issued,
            "trained": self.trained,
            "filtered": dict(self.filtered),
            "deadlettered": self.deadlettered,
            "in_flight": self.in_flight,
            "duplicates_caught": self.duplicates_caught,
            "lost": len(self.lost),
            "trained_twice": len(self.trained_twice),
            "ended_twice": len(self.ended_twice),
            "never_issued": len(self.never_issued),
            "deadlettered_unissued": self.deadlettered_unissued,
            "examples": {
                "lost": self.lost[:10],
                "trained_twice": self.trained_twice[:10],
                "ended_twice": self.ended_twice[:10],
                "never_issued": self.never_issued[:10],
            },
        }


async def read_batches(
    js: JetStreamContext, names: Names, from_seq: int = 1, batch: int = 256
) -> AsyncIterator[tuple[int, rollout_pb2.LedgerBatch]]:
    """Every ledger message from ``from_seq`` on, oldest first, with its sequence (an ephemeral consumer, no acks)."""
    info = await js.stream_info(names.ledger_stream)
    if not info.state.messages or info.state.last_seq < from_seq:
        return
    sub = await js.pull_subscribe(
        names.ledger("*"),
        stream=names.ledger_stream,
        config=ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=from_seq,
            inactive_threshold=60.0,
        ),
    )
    try:
        while True:
            msgs = await sub.fetch(batch, timeout=5.0)
            for m in msgs:
                yield m.metadata.sequence.stream, decode_ledger_batch(m.data)
            if not msgs or msgs[-1].metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()


async def read_entries(js: JetStreamContext, names: Names) -> list[rollout_pb2.LedgerEntry]:
    """Every ledger entry, oldest first."""
    return [e async for _, batch in read_batches(js, names) for e in batch.entries]


async def queued_ids(js: JetStreamContext, stream: str, subject: str) -> set[str]:
    """Message ids (task ids) still held by a work-queue stream on ``subject``."""
    ids: set[str] = set()
    info = await js.stream_info(stream)
    seq = info.state.first_seq
    while info.state.messages:
        try:
            msg = await js.get_msg(stream, seq, subject=subject, next=True)
        except NotFoundError:
            break
        msg_id = (msg.headers or {}).get("Nats-Msg-Id")
        if msg_id:
            ids.add(msg_id)
        assert msg.seq is not None  # a stored message has its sequence
        seq = msg.seq + 1
    return ids


def tally(
    entries: list[rollout_pb2.LedgerEntry], queued: set[str], issued_after_queue_read: frozenset[str] = frozenset()
) -> Audit:
    """Classify every task from its entries and what the queues hold.

    ``issued_after_queue_read``: tasks issued after ``queued`` was read, which
    count as in flight while they have no terminal event.
    """
    by_task: dict[str, list[rollout_pb2.LedgerEntry]] = defaultdict(list)
    for e in entries:
        by_task[e.task_id].append(e)
    audit = Audit()
    filtered: Counter[str] = Counter()
    for task_id, events in by_task.items():
        kinds = Counter(e.event for e in events)
        if not kinds[Event.LEDGER_EVENT_ISSUED]:
            # Garbage published under an id nobody issued is only dead-lettered;
            # anything else happening to an unissued id is an anomaly.
            if set(kinds) == {Event.LEDGER_EVENT_DEADLETTERED}:
                audit.deadlettered_unissued += 1
            else:
                audit.never_issued.append(task_id)
            continue
        audit.issued += 1
        audit.duplicates_caught += kinds[Event.LEDGER_EVENT_DUPLICATE]
        # Trainings are counted by batch: the same batch's record stored twice
        # (past the duplicate window) is one training, another batch is another.
        if len({e.batch_id for e in events if e.event == Event.LEDGER_EVENT_TRAINED}) > 1:
            audit.trained_twice.append(task_id)
        ends = [e for e in events if e.event in TERMINAL]
        if len({(e.event, e.reason) for e in ends}) > 1:
            audit.ended_twice.append(task_id)
        if not ends:
            if task_id in queued or task_id in issued_after_queue_read:
                audit.in_flight += 1
            else:
                audit.lost.append(task_id)
            continue
        end = ends[0]
        if end.event == Event.LEDGER_EVENT_TRAINED:
            audit.trained += 1
        elif end.event == Event.LEDGER_EVENT_FILTERED:
            filtered[end.reason] += 1
        else:
            audit.deadlettered += 1
    audit.filtered = dict(filtered)
    return audit


async def audit(js: JetStreamContext, names: Names) -> Audit:
    """Audit the run under ``names`` as it stands now."""
    # Entries, then queues, then entries again: a task's terminal event is
    # recorded before its message leaves the queue, so a task issued before
    # the queue read with no terminal event after it must be in a queue.
    before = {e.task_id for e in await read_entries(js, names) if e.event == Event.LEDGER_EVENT_ISSUED}
    queued = await queued_ids(js, names.tasks_stream, names.train_tasks)
    queued |= await queued_ids(js, names.rollouts_stream, names.rollouts)
    entries = await read_entries(js, names)
    recent = frozenset(e.task_id for e in entries if e.event == Event.LEDGER_EVENT_ISSUED) - before
    result = tally(entries, queued, recent)
    log.info("ledger audit: %s", {k: v for k, v in result.as_dict().items() if k != "examples"})
    return result
