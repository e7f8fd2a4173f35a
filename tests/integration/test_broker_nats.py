"""The broker against a real nats-server and over real gRPC.

The test plays the generators (leasing prompt tasks from the work queue and
publishing rollout groups) and the learner (NextBatch / Ack), and checks
what the broker does with real JetStream messages: back-pressure, batches,
the zero-variance filter, deduplication, dead-lettering, acks.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from asymptote.config import NatsSettings
from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc
from asymptote.errors import ConfigError
from asymptote.jetstream.names import Names, ensure_bucket
from asymptote.ledger import audit, read_entries
from asymptote.nats_local import NatsServer, free_port
from asymptote.policy import publish_policy
from asymptote.tasks import ArithmeticSettings
from services.broker.config import BrokerConfig, EvalSettings, SamplingSettings, ZeroVariance
from services.broker.main import serve
from services.broker.pipeline import STATE_KEY
from tests.helpers.waiting import wait_until_async

_prefixes = itertools.count()
Event = rollout_pb2.LedgerEvent


def make_group(task: rollout_pb2.GenerationTask, rewards: list[float], version: int = 0) -> rollout_pb2.RolloutGroup:
    completions = [
        rollout_pb2.Completion(
            token_ids=[3, 4, 2],
            logprobs=[-0.5, -0.25, -0.1],
            version_spans=[rollout_pb2.VersionSpan(version=version, start=0, end=3)],
            reward=r,
        )
        for r in rewards
    ]
    return rollout_pb2.RolloutGroup(
        group_id=task.task_id,
        task=task,
        prompt_token_ids=[5, 6, 7],
        completions=completions,
        generator_id="test-generator",
        min_version=version,
        max_version=version,
    )


class Harness:
    def __init__(
        self,
        server: NatsServer,
        batch_prompts: int = 2,
        outstanding: int = 4,
        ack_wait_s: float = 30.0,
        zero_variance: ZeroVariance = "drop",
    ) -> None:
        self.server = server
        self.prefix = f"it{next(_prefixes)}"
        self.names = Names(self.prefix)
        self.config = BrokerConfig(
            nats=NatsSettings(url=server.url),
            prefix=self.prefix,
            grpc={"port": free_port()},
            http={"port": free_port()},
            task=ArithmeticSettings(num_train=40, num_heldout=3, max_digits=2),
            sampling=SamplingSettings(group_size=2, max_tokens=4),
            eval=EvalSettings(every_versions=1000, num_samples=2),
            batch_prompts=batch_prompts,
            max_outstanding_tasks=outstanding,
            ack_wait_s=ack_wait_s,
            zero_variance=zero_variance,
            log_format="text",
        )
        self.stop = asyncio.Event()
        self.nc: NatsClient
        self.js: JetStreamContext
        self.task: asyncio.Task[None]
        self.channel: grpc.aio.Channel
        self.stub: services_pb2_grpc.BrokerStub

    async def start_broker(self) -> None:
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(serve(self.config, self.stop))
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.config.grpc.port}")
        self.stub = services_pb2_grpc.BrokerStub(self.channel)

    async def stop_broker(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 30)
        await self.channel.close()

    async def restart_broker(self) -> None:
        """A new broker process on the same run: nothing of the old one's memory survives."""
        await self.stop_broker()
        self.config = self.config.model_copy(
            update={
                "grpc": self.config.grpc.model_copy(update={"port": free_port()}),
                "http": self.config.http.model_copy(update={"port": free_port()}),
            }
        )
        await self.start_broker()
        await self.serving()

    async def serving(self) -> None:
        """Wait until the broker answers over gRPC."""
        await self.stub.Status(services_pb2.StatusRequest(), wait_for_ready=True, timeout=30.0)


@asynccontextmanager
async def running(h: Harness) -> AsyncIterator[Harness]:
    """The broker serving, the learner's first version announced, a client connected."""
    await h.start_broker()
    nc = await nats_connect(h.server)
    h.nc, h.js = nc, nc.jetstream()

    async def policy_bucket() -> KeyValue | None:
        try:
            return await h.js.key_value(h.names.policy_bucket)
        except BucketNotFoundError:
            return None

    kv = await wait_until_async(policy_bucket, 10, "the broker to create the policy bucket", interval_s=0.1)
    assert kv is not None  # wait_until_async returns only a truthy value
    # The broker waits for the learner's first version before issuing.
    await publish_policy(kv, h.names, rollout_pb2.PolicyVersion(version=0, weights_endpoint="x:1", digest="00"))
    try:
        yield h
    finally:
        await h.stop_broker()
        await nc.close()


@pytest.fixture
async def harness(nats: NatsServer, request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """A running broker; parametrize it indirectly with a zero_variance mode (default: the config's)."""
    async with running(Harness(nats, zero_variance=getattr(request, "param", "drop"))) as h:
        yield h


async def nats_connect(server: NatsServer) -> NatsClient:
    return await nats.connect(server.url)


async def lease(h: Harness, num: int, timeout_s: float = 10.0) -> list[tuple[rollout_pb2.GenerationTask, object]]:
    """Lease ``num`` tasks the way generators do (the shared durable consumer)."""
    sub = await h.js.pull_subscribe(
        h.names.all_tasks,
        durable=h.names.generators_consumer,
        stream=h.names.tasks_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=60.0),
    )
    got: list[tuple[rollout_pb2.GenerationTask, object]] = []
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(got) < num and asyncio.get_running_loop().time() < deadline:
        try:
            msgs = await sub.fetch(batch=num - len(got), timeout=1.0)
        except TimeoutError:
            continue
        got.extend((rollout_pb2.GenerationTask.FromString(m.data), m) for m in msgs)
    return got


async def publish_group(h: Harness, group: rollout_pb2.RolloutGroup) -> bool:
    ack = await h.js.publish(h.names.rollouts, group.SerializeToString(), headers={"Nats-Msg-Id": group.group_id})
    return bool(ack.duplicate)


async def next_batch(
    h: Harness, timeout_s: float = 10.0
) -> tuple[services_pb2.BatchHeader, list[rollout_pb2.RolloutGroup]]:
    header, groups = None, []
    async for part in h.stub.NextBatch(services_pb2.NextBatchRequest(learner_version=0, timeout_s=timeout_s)):
        if part.WhichOneof("part") == "header":
            header = part.header
        else:
            groups.append(part.group)
    assert header is not None
    return header, groups


async def stream_count(h: Harness, stream: str) -> int:
    return int((await h.js.stream_info(stream)).state.messages)


@pytest.mark.parametrize("harness", ["refill"], indirect=True)
async def test_back_pressure_batches_filters_and_acks(harness: Harness) -> None:
    h = harness

    # Back-pressure: with nothing consumed, at most `outstanding` train tasks exist.
    # Awaited: the broker itself counted the 4 pending (so it issues no more).
    async def counted_four_pending() -> bool:
        status = await h.stub.Status(services_pb2.StatusRequest(), wait_for_ready=True, timeout=30.0)
        return status.gauges["pending_tasks"] == 4

    await wait_until_async(counted_four_pending, 30, "the broker to count 4 pending train tasks")
    info = await h.js.stream_info(h.names.tasks_stream, subjects_filter=">")
    assert info.state.subjects == {h.names.train_tasks: 4, h.names.eval_tasks: 3}
    assert h.config.outstanding_limit == 4

    leased = await lease(h, 4)
    assert len(leased) == 4
    kinds = {t.kind for t, _ in leased}
    train = [(t, m) for t, m in leased if t.kind == rollout_pb2.TASK_KIND_TRAIN]
    # R0's eval round (3 held-out prompts) was queued ahead of the train tasks.
    assert rollout_pb2.TASK_KIND_EVAL in kinds
    evals_first = [t.kind for t, _ in leased][:3]
    assert evals_first == [rollout_pb2.TASK_KIND_EVAL] * 3

    more = await lease(h, 3)
    train += [(t, m) for t, m in more if t.kind == rollout_pb2.TASK_KIND_TRAIN]
    assert len(train) >= 3
    (t1, _), (t2, _), (t3, _) = train[:3]
    assert not await publish_group(h, make_group(t1, [1.0, 0.0]))
    assert await publish_group(h, make_group(t1, [1.0, 0.0])), "a re-publish must be deduplicated"
    flat = make_group(t2, [0.0, 0.0])  # zero variance: both completions ran out of room
    for c in flat.completions:
        c.interrupted, c.truncated = True, True
    assert not await publish_group(h, flat)
    assert not await publish_group(h, make_group(t3, [0.0, 1.0]))
    for _, m in train[:3]:
        await m.ack()  # type: ignore[attr-defined]

    header, groups = await next_batch(h)
    assert header.batch_id
    assert [g.group_id for g in groups] == [t1.task_id, t3.task_id]
    assert header.num_zero_variance == 1
    # Counted before the filter dropped the flat group (the re-publish was deduplicated by JetStream).
    assert (header.num_completions, header.num_interrupted, header.num_truncated) == (6, 2, 2)
    # Held until the learner acks: both groups are still in the stream (once the
    # broker's ack of the filtered group, sent without waiting, has landed).
    await wait_for_count(h, h.names.rollouts_stream, 2)
    resp = await h.stub.Ack(services_pb2.AckRequest(batch_ids=[header.batch_id, "nope"]))
    assert resp.num_acked == 2
    assert list(resp.unknown_batch_ids) == ["nope"]
    await wait_for_count(h, h.names.rollouts_stream, 0)

    status = await h.stub.Status(services_pb2.StatusRequest())
    assert status.gauges["groups_trained"] == 2
    assert status.gauges["dropped_zero_variance"] == 1


@pytest.mark.parametrize(
    ("harness", "served", "num_zero_variance"),
    [("drop", ["t1", "t2"], 0), ("keep", ["t1", "t2"], 0), ("refill", ["t1", "t3"], 1)],
    indirect=["harness"],
)
async def test_zero_variance_modes_over_nats_and_grpc(
    harness: Harness, served: list[str], num_zero_variance: int
) -> None:
    """drop and keep serve the next B groups, flat ones included; refill drops the flat one and fills the
    batch from the next; the header tells the learner which, and every group is acked once accounted for."""
    h = harness
    train = [t for t, _ in await lease(h, 7) if t.kind == rollout_pb2.TASK_KIND_TRAIN][:3]
    assert len(train) == 3
    tasks = dict(zip(["t1", "t2", "t3"], train))
    for name, rewards in (("t1", [1.0, 0.0]), ("t2", [0.0, 0.0]), ("t3", [0.0, 1.0])):
        assert not await publish_group(h, make_group(tasks[name], rewards))
    header, groups = await next_batch(h)
    assert [g.group_id for g in groups] == [tasks[name].task_id for name in served]
    assert header.num_groups == 2 and header.num_zero_variance == num_zero_variance
    assert header.keep_zero_variance == (h.config.zero_variance == "keep")
    await h.stub.Ack(services_pb2.AckRequest(batch_ids=[header.batch_id]))
    # Left in the stream: the group no batch took yet (drop, keep); none under refill.
    await wait_for_count(h, h.names.rollouts_stream, 1 - num_zero_variance)


async def test_poison_is_dead_lettered_and_broker_keeps_serving(harness: Harness) -> None:
    h = harness
    await h.js.publish(h.names.rollouts, b"\xff\x00 not a protobuf", headers={"Nats-Msg-Id": "poison-1"})
    bad = rollout_pb2.RolloutGroup(
        group_id="bad-1",
        prompt_token_ids=[1],
        completions=[rollout_pb2.Completion(token_ids=[1, 2], logprobs=[-0.1], reward=1.0)],
    )
    await h.js.publish(h.names.rollouts, bad.SerializeToString(), headers={"Nats-Msg-Id": "bad-1"})
    await wait_for_count(h, h.names.deadletter_stream, 2)
    sub = await h.js.subscribe(h.names.deadletter("rollouts"), ordered_consumer=True)
    reasons = []
    for _ in range(2):
        msg = await sub.next_msg(timeout=5)
        reasons.append(msg.headers["Asymptote-Reason"])
    assert any("undecodable" in r for r in reasons)
    assert any("1 logprobs for 2 tokens" in r for r in reasons)
    # Still serving: a good pair of groups makes a batch.
    leased = [(t, m) for t, m in await lease(h, 7) if t.kind == rollout_pb2.TASK_KIND_TRAIN][:2]
    for t, m in leased:
        await publish_group(h, make_group(t, [1.0, 0.0]))
        await m.ack()  # type: ignore[attr-defined]
    header, groups = await next_batch(h)
    assert header.num_groups == 2 and len(groups) == 2


async def test_release_unacked_serves_the_same_groups_again(harness: Harness) -> None:
    h = harness
    leased = [(t, m) for t, m in await lease(h, 7) if t.kind == rollout_pb2.TASK_KIND_TRAIN][:2]
    for t, m in leased:
        await publish_group(h, make_group(t, [1.0, 0.0]))
        await m.ack()  # type: ignore[attr-defined]
    first, groups = await next_batch(h)
    # The learner restarted before acking: it asks for everything back.
    await h.stub.Ack(services_pb2.AckRequest(release_unacked=True))
    second, again = await next_batch(h)
    assert second.batch_id != first.batch_id
    assert [g.group_id for g in again] == [g.group_id for g in groups]


async def test_no_batch_in_time_gives_an_empty_header(harness: Harness) -> None:
    header, groups = await next_batch(harness, timeout_s=0.3)
    assert header.batch_id == "" and groups == []


async def publish_copy(h: Harness, group: rollout_pb2.RolloutGroup, msg_id: str) -> None:
    """Another copy of a group, as one published again after JetStream's dedup window has passed."""
    await h.js.publish(h.names.rollouts, group.SerializeToString(), headers={"Nats-Msg-Id": msg_id})


async def wait_for_count(h: Harness, stream: str, count: int, timeout_s: float = 10.0) -> None:
    """Wait until ``stream`` holds exactly ``count`` messages."""

    async def counted() -> bool:
        return await stream_count(h, stream) == count

    await wait_until_async(counted, timeout_s, f"{stream} to hold {count} messages", interval_s=0.1)


async def count_ledger_reads(h: Harness) -> list[int]:
    """Reads of the ledger stream (each makes a consumer on it), counted as the server receives them."""
    seen = [0]

    async def count(msg: object) -> None:
        seen[0] += 1

    for subject in ("", ".>"):
        await h.nc.subscribe(f"$JS.API.CONSUMER.CREATE.{h.names.ledger_stream}{subject}", cb=count)
    return seen


async def task_events(h: Harness, task_id: str) -> Counter[int]:
    return Counter(e.event for e in await read_entries(h.js, h.names) if e.task_id == task_id)


async def test_a_copy_of_an_ended_task_is_never_served_also_by_a_restarted_broker(harness: Harness) -> None:
    h = harness
    reads = await count_ledger_reads(h)
    train = [(t, m) for t, m in await lease(h, 7) if t.kind == rollout_pb2.TASK_KIND_TRAIN][:2]
    for t, m in train:
        await publish_group(h, make_group(t, [1.0, 0.0]))
        await m.ack()  # type: ignore[attr-defined]
    header, groups = await next_batch(h)
    resp = await h.stub.Ack(
        services_pb2.AckRequest(
            batches=[services_pb2.AckedBatch(batch_id=header.batch_id, group_ids=[g.group_id for g in groups])]
        )
    )
    assert resp.num_acked == 2
    t1 = train[0][0]

    # The broker that recorded the outcome knows it: the copy is a duplicate, with no lookup.
    await publish_copy(h, make_group(t1, [1.0, 0.0]), f"{t1.task_id}-copy-1")
    await wait_for_count(h, h.names.rollouts_stream, 0)
    assert reads[0] == 0

    # A restarted broker did not record it: it reads the ledger once, from the task's
    # "issued" record on, then knows.
    await h.restart_broker()
    await publish_copy(h, make_group(t1, [0.0, 1.0]), f"{t1.task_id}-copy-2")
    await wait_for_count(h, h.names.rollouts_stream, 0)
    looked_up = reads[0]
    assert looked_up >= 1
    await publish_copy(h, make_group(t1, [1.0, 1.0]), f"{t1.task_id}-copy-3")
    await wait_for_count(h, h.names.rollouts_stream, 0)
    assert reads[0] == looked_up

    header, groups = await next_batch(h, timeout_s=0.5)
    assert groups == []  # no copy was ever served
    # Trained once; the three copies share one "duplicate" record (same event, no batch: one message id).
    events = await task_events(h, t1.task_id)
    assert events == {Event.LEDGER_EVENT_ISSUED: 1, Event.LEDGER_EVENT_TRAINED: 1, Event.LEDGER_EVENT_DUPLICATE: 1}
    status = await h.stub.Status(services_pb2.StatusRequest())
    assert status.gauges["dropped_duplicate"] == 2 and status.gauges["groups_received"] == 2
    result = await audit(h.js, h.names)
    assert result.ok and result.trained == 2 and result.trained_twice == []


async def test_a_held_group_whose_copy_was_caught_is_served_after_a_restart(nats: NatsServer) -> None:
    # A broker restarted while holding a group whose second copy it had caught
    # finds a "duplicate" as the task's newest entry; the task has no outcome,
    # so the redelivered group is served, not dropped as ended.
    async with running(Harness(nats, batch_prompts=1, outstanding=2, ack_wait_s=2.0)) as h:
        (t1, m1), *_ = [(t, m) for t, m in await lease(h, 5) if t.kind == rollout_pb2.TASK_KIND_TRAIN]
        await publish_group(h, make_group(t1, [1.0, 0.0]))
        await m1.ack()  # type: ignore[attr-defined]
        await publish_copy(h, make_group(t1, [1.0, 0.0]), f"{t1.task_id}-copy")
        await wait_for_count(h, h.names.rollouts_stream, 1)  # the copy acked, the group held
        assert await task_events(h, t1.task_id) == {Event.LEDGER_EVENT_ISSUED: 1, Event.LEDGER_EVENT_DUPLICATE: 1}

        await h.restart_broker()  # the held group was never acked: JetStream redelivers it
        header, groups = await next_batch(h, timeout_s=20.0)
        assert [g.group_id for g in groups] == [t1.task_id]
        await h.stub.Ack(services_pb2.AckRequest(batch_ids=[header.batch_id]))
        await wait_for_count(h, h.names.rollouts_stream, 0)
        assert (await task_events(h, t1.task_id))[Event.LEDGER_EVENT_TRAINED] == 1
        result = await audit(h.js, h.names)
        assert result.ok and result.trained == 1 and result.lost == []


async def test_packed_batches_carry_the_same_groups_in_parts_of_bounded_size(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness
    train = [(t, m) for t, m in await lease(h, 7) if t.kind == rollout_pb2.TASK_KIND_TRAIN][:4]
    for t, m in train:
        await publish_group(h, make_group(t, [1.0, 0.0]))
        await m.ack()  # type: ignore[attr-defined]

    async def parts(packed: bool) -> tuple[services_pb2.BatchHeader, list[list[str]]]:
        request = services_pb2.NextBatchRequest(learner_version=0, timeout_s=10.0, packed=packed)
        got = [part async for part in h.stub.NextBatch(request)]
        assert got[0].WhichOneof("part") == "header"
        kinds = {p.WhichOneof("part") for p in got[1:]}
        assert kinds == {"groups" if packed else "group"}
        ids = [[g.group_id for g in p.groups.groups] if packed else [p.group.group_id] for p in got[1:]]
        return got[0].header, ids

    header, packed = await parts(packed=True)
    assert packed == [[train[0][0].task_id, train[1][0].task_id]] and header.num_groups == 2
    # Parts stop short of the size bound; a group larger than it goes alone.
    from services.broker import server

    monkeypatch.setattr(server, "PACKED_PART_BYTES", make_group(train[2][0], [1.0, 0.0]).ByteSize() + 1)
    header2, packed2 = await parts(packed=True)
    assert packed2 == [[train[2][0].task_id], [train[3][0].task_id]] and header2.num_groups == 2
    resp = await h.stub.Ack(services_pb2.AckRequest(batch_ids=[header.batch_id, header2.batch_id]))
    assert resp.num_acked == 4


@pytest.mark.parametrize("shaping", ["none", "overlong", "truncated"])
async def test_the_learner_gets_each_group_as_published_or_as_shaped(nats: NatsServer, shaping: str) -> None:
    """Unshaped groups go to the learner in the bytes they arrived in; shaped ones with their new rewards:
    DAPO's overlong penalty, or a right answer cut at max_tokens earning 0 (the default)."""
    h = Harness(nats)
    if shaping == "overlong":  # 3 tokens against max_tokens 4 and a 2-token punishment interval: -0.5 each
        h.config = h.config.model_copy(
            update={"sampling": SamplingSettings(group_size=2, max_tokens=4, overlong_cache_tokens=2)}
        )
    expected = {"none": [1.0, 0.0], "overlong": [0.5, -0.5], "truncated": [0.0, 0.0]}[shaping]
    async with running(h):
        train = [(t, m) for t, m in await lease(h, 7) if t.kind == rollout_pb2.TASK_KIND_TRAIN][:2]
        published = [make_group(t, [1.0, 0.0]) for t, _ in train]
        if shaping == "truncated":
            for group in published:
                group.completions[0].truncated = True
        for (_, m), group in zip(train, published, strict=True):
            await publish_group(h, group)
            await m.ack()  # type: ignore[attr-defined]
        header, got = await next_batch(h)
        assert header.num_groups == 2
        by_id = {g.group_id: g for g in got}
        for group in published:
            served = by_id[group.group_id]
            rewards = [c.reward for c in served.completions]
            assert rewards == expected
            if shaping == "none":
                assert served == group
            else:  # only the rewards changed
                for c in served.completions:
                    c.reward = 0.0
                for c in group.completions:
                    c.reward = 0.0
                assert served == group


async def test_a_corrupt_curriculum_state_stops_the_broker_and_is_left_as_it_was(nats: NatsServer) -> None:
    # Only a missing key is a fresh run: a state that cannot be decoded must not become a fresh
    # curriculum (that would issue every retired prompt again) nor be overwritten by one.
    h = Harness(nats)
    nc = await nats_connect(nats)
    try:
        kv = await ensure_bucket(nc.jetstream(), h.names.curriculum_bucket, replicas=1)
        corrupt = b"\xff\xff\xff\xff not a CurriculumState"
        await kv.put(STATE_KEY, corrupt)
        with pytest.raises(ConfigError) as refused:
            await asyncio.wait_for(serve(h.config, asyncio.Event()), 60)
        message = str(refused.value)
        assert f"bucket {h.names.curriculum_bucket!r}" in message and f"key {STATE_KEY!r}" in message
        assert "corrupt" in message and "\n" not in message
        assert (await kv.get(STATE_KEY)).value == corrupt
        # Refused before issuing anything.
        assert (await nc.jetstream().stream_info(h.names.tasks_stream)).state.messages == 0
    finally:
        await nc.close()


async def test_a_batch_and_its_redelivered_copy_in_one_ack_are_trained_once(nats: NatsServer) -> None:
    # The broker restarted while the learner held a batch it had trained and not acked (its checkpoint
    # was not written yet); the groups came back redelivered in another batch, which the learner kept
    # out of the loss as already trained. The checkpoint's Ack names both batches.
    async with running(Harness(nats, ack_wait_s=2.0)) as h:
        for t, m in [(t, m) for t, m in await lease(h, 7) if t.kind == rollout_pb2.TASK_KIND_TRAIN][:2]:
            await publish_group(h, make_group(t, [1.0, 0.0]))
            await m.ack()  # type: ignore[attr-defined]
        first, groups = await next_batch(h)
        ids = [g.group_id for g in groups]
        await h.restart_broker()
        second, again = await next_batch(h, timeout_s=20.0)
        assert [g.group_id for g in again] == ids
        resp = await h.stub.Ack(
            services_pb2.AckRequest(
                batches=[
                    services_pb2.AckedBatch(batch_id=first.batch_id, group_ids=ids),
                    services_pb2.AckedBatch(batch_id=second.batch_id, group_ids=ids, duplicate_group_ids=ids),
                ]
            )
        )
        assert resp.num_acked == 2 and list(resp.unknown_batch_ids) == [first.batch_id]
        await wait_for_count(h, h.names.rollouts_stream, 0)
        trainings = [e for e in await read_entries(h.js, h.names) if e.event == Event.LEDGER_EVENT_TRAINED]
        assert sorted((e.task_id, e.batch_id) for e in trainings) == sorted((gid, first.batch_id) for gid in ids)
        for gid in ids:
            assert await task_events(h, gid) == {
                Event.LEDGER_EVENT_ISSUED: 1,
                Event.LEDGER_EVENT_TRAINED: 1,
                Event.LEDGER_EVENT_DUPLICATE: 1,
            }
        status = await h.stub.Status(services_pb2.StatusRequest())
        assert status.gauges["groups_trained"] == 2
        result = await audit(h.js, h.names)
        assert result.ok and result.trained == 2 and result.trained_twice == []
