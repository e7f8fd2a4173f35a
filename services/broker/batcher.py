"""Admission and continuous batch assembly.

Owns what happens to a valid rollout group (asymptote.messages decodes and
validates it) between JetStream and the learner: the zero-variance filter,
the staleness bound (PipelineRL-k), the buffer of ready groups, batches
handed out and waiting for the learner's ack, and the counters of
everything dropped with its reason and of what was received (completions,
interrupted, truncated) before any filter.
Messages are held unacked until the learner confirms; the batcher never
acks a group it has not either dropped (with a reason) or seen trained.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from asymptote.contracts.v1 import rollout_pb2, services_pb2
from asymptote.ledger import Event, Ledger
from services.broker.config import ZeroVariance

log = logging.getLogger(__name__)


class Ackable(Protocol):
    async def ack(self) -> None: ...
    async def nak(self, delay: float | None = None) -> None: ...
    async def in_progress(self) -> None: ...


@dataclass
class Held:
    group: rollout_pb2.RolloutGroup
    msg: Ackable
    received_s: float = field(default_factory=time.monotonic)
    data: bytes | None = None
    """The group serialized as the learner gets it (the bytes it arrived in), if not changed since."""

    def serialized(self) -> bytes:
        return self.data if self.data is not None else self.group.SerializeToString()


@dataclass
class HandedOut:
    batch_id: str
    items: list[Held]
    handed_s: float = field(default_factory=time.monotonic)


def is_zero_variance(group: rollout_pb2.RolloutGroup) -> bool:
    """All G rewards equal: no gradient (tests equality, so {-1,+1} works)."""
    first = group.completions[0].reward
    return all(c.reward == first for c in group.completions)


ROLLOUT_COUNTS = ("completions", "interrupted", "truncated")
"""What the batcher counts of each group's completions on arrival: all, those interrupted (thinking
budget) and those truncated (length cap)."""


def pass_rate(group: rollout_pb2.RolloutGroup) -> float:
    """The share of the group's episodes (completions, in a single-turn group) with a positive reward."""
    rewards = [c.reward for c in group.completions if not c.continues_episode]
    return sum(1 for r in rewards if r > 0) / len(rewards)


def no_stream_seq(msg: Ackable) -> int | None:
    return None


def _carried(batch: HandedOut | None, group_ids: Sequence[str]) -> list[str]:
    """The groups an acked batch carried: a known batch's own, else those the learner names."""
    return list(group_ids) if batch is None else [h.group.group_id for h in batch.items]


class Batcher:
    def __init__(
        self,
        batch_prompts: int,
        max_staleness_versions: int,
        ledger: Ledger | None = None,
        stream_seq: Callable[[Ackable], int | None] = no_stream_seq,
        zero_variance: ZeroVariance = "drop",
    ) -> None:
        self.batch_prompts = batch_prompts
        self.zero_variance = zero_variance
        """refill: flat groups are dropped here and the batch waits for B informative ones; drop and keep:
        they are batched like any other, and the batch's header tells the learner whether they count in
        the loss's denominators (keep) or not (drop)."""
        self.max_staleness = max_staleness_versions
        self.ledger = ledger
        self.stream_seq = stream_seq
        """A message's stream sequence: a redelivery has the same, a second copy another (None: unknown)."""
        self._held: dict[str, Held] = {}
        """Every group held now (ready or handed out), by group id."""
        self.ready: deque[Held] = deque()
        self.handed_out: dict[str, HandedOut] = {}
        self._overdue: set[str] = set()
        """Batches handed out past the release deadline and not acked (:meth:`report_overdue`)."""
        self.dropped: Counter[str] = Counter()
        self.num_received = 0
        self.num_served = 0
        self.num_trained = 0
        self.learner_version = 0
        self.served_at_version: int | None = None
        """Learner version of the last batch handed out (synchronous mode waits past it)."""
        self._since_batch: Counter[str] = Counter()
        self.rollouts: Counter[str] = Counter()
        """``ROLLOUT_COUNTS`` of every group received once (no duplicate), before any filter."""
        self._rollouts_since_batch: Counter[str] = Counter()
        self._changed = asyncio.Condition()
        self._outbox_entries: list[rollout_pb2.LedgerEntry] = []
        self._outbox_msgs: list[Ackable] = []
        self.taken = asyncio.Event()
        """Set when a batch is handed out (room for more tasks); the issuer clears it."""
        self.learner_pace: float | None = None
        """Groups per second the learner gets through when fed (EWMA): a batch's size over the time
        from handing it out to the learner's next request, which leaves out any wait for data."""
        self._last_handed: tuple[float, int] | None = None

    @property
    def keep_zero_variance(self) -> bool:
        """Flat groups count in the loss's denominators (the learner reads it in each batch's header)."""
        return self.zero_variance == "keep"

    def is_stale(self, group: rollout_pb2.RolloutGroup, learner_version: int) -> bool:
        return learner_version - int(group.min_version) > self.max_staleness

    async def admit(self, group: rollout_pb2.RolloutGroup, msg: Ackable, ended: bool = False) -> str | None:
        """Take one decoded, validated group; returns the drop reason, if any (see :meth:`admit_all`)."""
        (reason,) = await self.admit_all([(group, msg, ended)])
        return reason

    async def admit_all(
        self,
        arrivals: Sequence[tuple[rollout_pb2.RolloutGroup, Ackable, bool]],
        data: Sequence[bytes | None] | None = None,
    ) -> list[str | None]:
        """Take decoded, validated groups with whether each one's task has ended; the drop reasons.

        A redelivery of a message held now (same stream sequence) replaces the
        held handle; another copy of a held group (its task was generated
        twice, e.g. when a generator died before acking it) is acked as a
        duplicate. ``ended``: the ledger already holds an outcome for this
        task, so this copy is acked as a duplicate and never served. The
        drops' ledger records are stored as one batch before any of their
        messages is acked. ``data``: each group's serialized bytes, served to
        the learner as they are (None where the group was changed since it
        was parsed, or not given: it is serialized again then).
        """
        num_ready = len(self.ready)
        serialized = data if data is not None else [None] * len(arrivals)
        reasons = [
            self._admit_one(group, msg, ended, raw)
            for (group, msg, ended), raw in zip(arrivals, serialized, strict=True)
        ]
        if len(self.ready) > num_ready:
            async with self._changed:
                self._changed.notify_all()
        await self.flush()
        return reasons

    def _admit_one(
        self, group: rollout_pb2.RolloutGroup, msg: Ackable, ended: bool, data: bytes | None = None
    ) -> str | None:
        held = self._held.get(group.group_id)
        if held is not None:
            # Sequences are read only here, on a collision (parsing them costs).
            seq = self.stream_seq(msg)
            if seq is None or self.stream_seq(held.msg) == seq:
                held.msg = msg
                return None
            return self._duplicate(group.group_id, msg, "second copy of a held group")
        self.num_received += 1
        if ended:
            return self._duplicate(group.group_id, msg, "copy of a task that already ended")
        # Counted before any filter: the interruption and truncation rates of what was generated.
        completions = group.completions
        interrupted = sum(c.interrupted for c in completions)
        truncated = sum(c.truncated for c in completions)
        for counts in (self.rollouts, self._rollouts_since_batch):
            counts["completions"] += len(completions)
            counts["interrupted"] += interrupted
            counts["truncated"] += truncated
        reason: str | None = None
        if self.zero_variance == "refill" and is_zero_variance(group):
            reason = "zero_variance"
        elif self.is_stale(group, self.learner_version):
            reason = "stale"
        if reason is not None:
            self._drop(group, msg, reason)
            return reason
        held = self._held[group.group_id] = Held(group, msg, data=data)
        self.ready.append(held)
        return None

    def _duplicate(self, group_id: str, msg: Ackable, why: str) -> str:
        self._stage(group_id, Event.LEDGER_EVENT_DUPLICATE, msg, why)
        self.dropped["duplicate"] += 1
        return "duplicate"

    def _stage(self, group_id: str, event: rollout_pb2.LedgerEvent, msg: Ackable, reason: str = "") -> None:
        """Queue a record and the ack that must follow it (see :meth:`flush`)."""
        if self.ledger is not None:
            self._outbox_entries.append(self.ledger.entry(group_id, event, reason, self.learner_version))
        self._outbox_msgs.append(msg)

    async def flush(self) -> None:
        """Store the queued records as one ledger batch, then ack their messages.

        Recorded before the ack: while a message is in the queue its group is
        in flight, and once it leaves, the ledger says why. A failed store
        leaves the messages unacked (JetStream redelivers them) and raises.
        """
        entries, msgs = self._outbox_entries, self._outbox_msgs
        if not msgs:
            return
        self._outbox_entries, self._outbox_msgs = [], []
        if self.ledger is not None:
            await self.ledger.record(*entries)
        for msg in msgs:
            await msg.ack()

    def _drop(self, group: rollout_pb2.RolloutGroup, msg: Ackable, reason: str) -> None:
        self._stage(group.group_id, Event.LEDGER_EVENT_FILTERED, msg, reason)
        self._held.pop(group.group_id, None)
        self.dropped[reason] += 1
        self._since_batch[reason] += 1

    async def set_learner_version(self, version: int) -> None:
        if version > self.learner_version:
            self.learner_version = version
            async with self._changed:
                self._changed.notify_all()

    async def next_batch(self, learner_version: int, num_groups: int, timeout_s: float) -> HandedOut | None:
        """Wait up to ``timeout_s`` for ``num_groups`` fresh groups and hand them out."""
        await self.set_learner_version(learner_version)
        if self._last_handed is not None:
            handed_s, num = self._last_handed
            # A learner asking again at once is far faster than any pipeline: floor its time at 1 ms.
            pace = num / max(time.monotonic() - handed_s, 1e-3)
            self.learner_pace = pace if self.learner_pace is None else 0.8 * self.learner_pace + 0.2 * pace
            self._last_handed = None
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while True:
                self._evict_stale()
                if len(self.ready) >= num_groups:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    break
            enough = len(self.ready) >= num_groups
            items = [self.ready.popleft() for _ in range(num_groups)] if enough else []
        try:
            await self.flush()  # the stale groups evicted meanwhile
        except BaseException:
            self.ready.extendleft(reversed(items))
            raise
        if not items:
            return None
        batch = HandedOut(uuid.uuid4().hex, items)
        self.served_at_version = self.learner_version
        self.handed_out[batch.batch_id] = batch
        self.num_served += len(items)
        self._last_handed = (time.monotonic(), len(items))
        self.taken.set()
        return batch

    def take_counters(self) -> Counter[str]:
        """Drops since the last batch (for the learner's step metrics)."""
        out, self._since_batch = self._since_batch, Counter()
        return out

    def header(self, batch: HandedOut) -> services_pb2.BatchHeader:
        """The header the learner gets with ``batch``: its counters since the previous batch (drops, and every
        completion received before any filter), and whether flat groups count in the loss. Takes the counters."""
        drops = self.take_counters()
        rollouts = self.take_rollout_counts()
        return services_pb2.BatchHeader(
            batch_id=batch.batch_id,
            num_groups=len(batch.items),
            num_zero_variance=drops.get("zero_variance", 0),
            num_stale_dropped=drops.get("stale", 0),
            oldest_group_age_s=time.monotonic() - min(h.received_s for h in batch.items),
            keep_zero_variance=self.keep_zero_variance,
            num_completions=rollouts["completions"],
            num_interrupted=rollouts["interrupted"],
            num_truncated=rollouts["truncated"],
        )

    def take_rollout_counts(self) -> Counter[str]:
        """``ROLLOUT_COUNTS`` summed over the groups received since the last batch (before any filter)."""
        out, self._rollouts_since_batch = self._rollouts_since_batch, Counter()
        return out

    def _evict_stale(self) -> None:
        kept: deque[Held] = deque()
        for held in self.ready:
            if self.is_stale(held.group, self.learner_version):
                self._drop(held.group, held.msg, "stale")
            else:
                kept.append(held)
        self.ready = kept

    async def ack(self, batches: Sequence[tuple[str, Sequence[str], Sequence[str]]]) -> tuple[int, list[str]]:
        """The learner's checkpoint holds these batches: record and ack their groups.

        ``batches``: (batch id, group ids it carried, of those the ones the
        learner recognised as already trained). Groups of a batch this broker
        does not know (it restarted since handing the batch out) are recorded
        under the same batch id, so their redelivered messages are acked, never
        served again, and a record the previous broker made is not doubled.
        A group named by several batches of the call is recorded trained once
        (see the loop below). Returns (groups acked, unknown batch ids).
        """
        acked = [
            (batch_id, self.handed_out.get(batch_id), group_ids, set(dups)) for batch_id, group_ids, dups in batches
        ]
        # One record for every group of the call, stored before any message is acked.
        if self.ledger is not None:
            ledger = self.ledger
            first = await self._first_outcomes(acked)
            # A group the call names twice (a batch handed out before a broker restart and its
            # redelivered copy, both in one checkpoint) is trained once: where the learner trained it,
            # else in the first batch naming it; every other naming is a duplicate.
            trained = {
                gid for _, batch, group_ids, dups in acked for gid in _carried(batch, group_ids) if gid not in dups
            }
            entries = []
            for batch_id, batch, group_ids, dups in acked:
                recorded_dups = set()
                for gid in _carried(batch, group_ids):
                    if gid in dups and (gid not in first or gid in trained):
                        recorded_dups.add(gid)
                        event = Event.LEDGER_EVENT_DUPLICATE
                    else:
                        trained.add(gid)
                        event = Event.LEDGER_EVENT_TRAINED
                    entries.append(ledger.entry(gid, event, policy_version=self.learner_version, batch_id=batch_id))
                dups &= recorded_dups
            await ledger.record(*entries)
        num, unknown = 0, []
        for batch_id, batch, group_ids, dups in acked:
            if batch is None:
                unknown.append(batch_id)
                self.num_trained += len(group_ids) - len(dups)
                continue
            if self.handed_out.pop(batch_id, None) is None:
                continue  # named twice in one call
            for held in batch.items:
                await held.msg.ack()
                self._held.pop(held.group.group_id, None)
            self.num_trained += len(batch.items) - len(dups)
            num += len(batch.items)
        if unknown:
            log.info(
                "%d acked batches were handed out before this broker started; their groups are recorded", len(unknown)
            )
        return num, unknown

    async def _first_outcomes(self, acked: Sequence[tuple[str, HandedOut | None, Sequence[str], set[str]]]) -> set[str]:
        """Of the groups the learner calls already trained, those with no outcome in the ledger yet.

        The learner skips a redelivered group it trained into the weights its
        checkpoint holds. When its ack of the first copy never arrived (the
        broker was gone when the learner stopped), this ack is the first the
        ledger hears of the training: the group is recorded as trained, not as
        a duplicate of an outcome that was never recorded.
        """
        assert self.ledger is not None
        seqs: dict[str, int] = {}
        named: list[str] = []
        for _, batch, group_ids, dups in acked:
            if batch is not None:
                seqs.update(
                    (h.group.group_id, int(h.group.task.ledger_seq)) for h in batch.items if h.group.group_id in dups
                )
            named += [gid for gid in _carried(batch, group_ids) if gid in dups]
        if not named:
            return set()
        ended = await self.ledger.ended([(gid, seqs.get(gid, 0)) for gid in named])
        return {gid for gid, done in zip(named, ended, strict=True) if not done}

    async def release(self, batch_ids: Sequence[str] | None = None) -> int:
        """Put handed-out batches back at the front of the queue (learner restarted)."""
        ids = list(self.handed_out) if batch_ids is None else list(batch_ids)
        items: list[Held] = []
        for batch_id in ids:
            batch = self.handed_out.pop(batch_id, None)
            if batch is not None:
                items.extend(batch.items)
        async with self._changed:
            self.ready.extendleft(reversed(items))
            self._changed.notify_all()
        if items:
            log.info("released %d groups of %d unacked batches back to the queue", len(items), len(ids))
        return len(items)

    async def release_expired(self, max_age_s: float) -> int:
        now = time.monotonic()
        expired = [b.batch_id for b in self.handed_out.values() if now - b.handed_s > max_age_s]
        return await self.release(expired) if expired else 0

    async def heartbeat(self) -> None:
        """Extend the ack deadline of every held message."""
        for held in list(self.ready) + [h for b in list(self.handed_out.values()) for h in b.items]:
            try:
                await held.msg.in_progress()
            except Exception as exc:  # a lost heartbeat only risks a redelivery
                log.warning("in_progress failed for group %s: %s", held.group.group_id, exc)

    @property
    def num_held(self) -> int:
        return len(self.ready) + sum(len(b.items) for b in self.handed_out.values())
