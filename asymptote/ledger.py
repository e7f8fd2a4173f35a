"""The ledger: what became of every issued train task, and its audit.

Owns recording ``LedgerEntry`` events on ``<prefix>.ledger.<task_id>`` (a
file-backed JetStream stream that nothing consumes away) and auditing them
against what the work-queue streams still hold. An issued task is, at any
moment, exactly one of: trained (its group is in a durable learner
checkpoint), filtered with a reason, dead-lettered, or in flight (its task
or its rollout group still sits in a work queue). The audit names every
task that is none of these (lost) and every task trained more than once.

Message ids make re-recording idempotent (a service that crashes and
repeats an action records it once), while a second training in another
batch carries another batch id and is counted, not hidden.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names
from asymptote.jetstream.publish import Outgoing, Publisher
from asymptote.messages import decode_ledger_entry

log = logging.getLogger(__name__)

Event = rollout_pb2.LedgerEvent
TERMINAL = (Event.LEDGER_EVENT_TRAINED, Event.LEDGER_EVENT_FILTERED, Event.LEDGER_EVENT_DEADLETTERED)


class Ledger:
    """Records events for one service, and answers whether a task has ended.

    The broker is the only writer of outcomes (one replica at a time), so
    what it recorded itself is the ledger's truth for those tasks: a task
    whose "issued" record this ledger stored fresh stays open until this
    ledger records its outcome. Only a task it never saw (issued before a
    restart, or forgotten past ``max_known``) costs a lookup, whose answer is
    kept as well. A restarted broker therefore still recognises every copy
    of a task that already ended, paying one lookup per task it inherits.
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
        """Whether a task has an outcome, for the tasks this ledger recorded or looked up (oldest first)."""
        self.num_lookups = 0
        """Tasks whose state had to be read from the stream (not known here)."""

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

    async def record(self, *entries: rollout_pb2.LedgerEntry) -> None:
        """Store ``entries`` (made by :meth:`entry`); returns once every one is stored, else raises
        (see Publisher.publish_all)."""
        duplicates = await self.publisher.publish_all(
            [
                Outgoing(
                    self.names.ledger(e.task_id),
                    e.SerializeToString(),
                    # Idempotent per event and batch: a repeated action is recorded
                    # once, a second training in another batch is not hidden.
                    f"{e.task_id}:{Event.Name(e.event)}:{e.batch_id}",
                )
                for e in entries
            ]
        )
        for e, duplicate in zip(entries, duplicates):
            if e.event in TERMINAL:
                self._remember(e.task_id, True)
            elif e.event == Event.LEDGER_EVENT_ISSUED and not duplicate:
                # Stored fresh: nothing came after it (an outcome can only follow
                # this record). A repeated "issued" says nothing: look it up.
                self._ended.setdefault(e.task_id, False)
                self._trim()

    def _remember(self, task_id: str, ended: bool) -> None:
        # Once ended, always ended: a lookup answered before this ledger
        # recorded the outcome must not reopen the task.
        self._ended[task_id] = self._ended.get(task_id, False) or ended
        self._trim()

    def _trim(self) -> None:
        while len(self._ended) > self.max_known:
            self._ended.popitem(last=False)

    def known_ended(self, task_id: str) -> bool | None:
        """Whether the task has an outcome, if this ledger knows without asking; None if not."""
        return self._ended.get(task_id)

    async def has_ended(self, task_id: str) -> bool:
        """Whether the task already has an outcome (trained, filtered, dead-lettered)."""
        known = self._ended.get(task_id)
        if known is not None:
            return known
        self.num_lookups += 1
        last = await self.last(task_id)
        if last is None or last.event == Event.LEDGER_EVENT_ISSUED:
            ended = False
        elif last.event in TERMINAL:
            ended = True
        else:  # a duplicate caught: while the task was still held, or after it ended
            ended = any(e.event in TERMINAL for e in await self.entries(task_id))
        if last is not None:  # an id nobody issued stays unknown
            self._remember(task_id, ended)
        return ended

    async def last(self, task_id: str) -> rollout_pb2.LedgerEntry | None:
        """The newest entry for ``task_id``, or None."""
        try:
            msg = await self.js.get_msg(self.names.ledger_stream, subject=self.names.ledger(task_id))
        except NotFoundError:
            return None
        return decode_ledger_entry(msg.data or b"")

    async def entries(self, task_id: str) -> list[rollout_pb2.LedgerEntry]:
        """Every entry for ``task_id``, oldest first (a task has a handful)."""
        out: list[rollout_pb2.LedgerEntry] = []
        seq = 1
        while True:
            try:
                msg = await self.js.get_msg(
                    self.names.ledger_stream, seq, subject=self.names.ledger(task_id), next=True
                )
            except NotFoundError:
                return out
            out.append(decode_ledger_entry(msg.data or b""))
            assert msg.seq is not None  # a stored message has its sequence
            seq = msg.seq + 1


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


async def read_entries(js: JetStreamContext, names: Names, batch: int = 2000) -> list[rollout_pb2.LedgerEntry]:
    """Every ledger entry, oldest first (an ephemeral consumer, no acks)."""
    info = await js.stream_info(names.ledger_stream)
    if not info.state.messages:
        return []
    sub = await js.pull_subscribe(
        names.ledger("*"),
        stream=names.ledger_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=60.0),
    )
    out: list[rollout_pb2.LedgerEntry] = []
    try:
        while True:
            msgs = await sub.fetch(batch, timeout=5.0)
            out.extend(decode_ledger_entry(m.data) for m in msgs)
            if not msgs or msgs[-1].metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out


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
        if kinds[Event.LEDGER_EVENT_TRAINED] > 1:
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
