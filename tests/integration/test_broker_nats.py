"""The broker against a real nats-server and over real gRPC.

The test plays the generators (leasing prompt tasks from the work queue and
publishing rollout groups) and the learner (NextBatch / Ack), and checks
what the broker does with real JetStream messages: back-pressure, batches,
the zero-variance filter, deduplication, dead-lettering, acks.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc
import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from asymptote.config import NatsSettings
from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc
from asymptote.nats_local import NatsServer, free_port
from asymptote.policy import publish_policy
from asymptote.streams import Names, ensure_bucket
from asymptote.tasks import TaskSettings
from services.broker.config import BrokerConfig, EvalSettings, SamplingSettings
from services.broker.main import serve

_prefixes = itertools.count()


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
        group_id=task.task_id, task=task, prompt_token_ids=[5, 6, 7], completions=completions,
        generator_id="test-generator", min_version=version, max_version=version,
    )


class Harness:
    def __init__(self, server: NatsServer, batch_prompts: int = 2, outstanding: int = 4) -> None:
        self.prefix = f"it{next(_prefixes)}"
        self.names = Names(self.prefix)
        self.grpc_port = free_port()
        self.config = BrokerConfig(
            nats=NatsSettings(url=server.url),
            prefix=self.prefix,
            grpc={"port": self.grpc_port},
            http={"port": free_port()},
            task=TaskSettings(num_train=40, num_heldout=3, max_digits=2),
            sampling=SamplingSettings(group_size=2, max_tokens=4),
            eval=EvalSettings(every_versions=1000, num_samples=2),
            batch_prompts=batch_prompts,
            max_outstanding_tasks=outstanding,
            log_format="text",
        )
        self.stop = asyncio.Event()


@pytest.fixture
async def harness(nats: NatsServer) -> AsyncIterator[Harness]:
    h = Harness(nats)
    task = asyncio.create_task(serve(h.config, h.stop))
    nc = await nats_connect(nats)
    h.nc, h.js = nc, nc.jetstream()
    # The broker waits for the learner's first version before issuing.
    for _ in range(100):
        try:
            kv = await h.js.key_value(h.names.policy_bucket)
            break
        except Exception:
            await asyncio.sleep(0.1)
    await publish_policy(kv, h.names, rollout_pb2.PolicyVersion(version=0, weights_endpoint="x:1", sha256="00"))
    h.channel = grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}")
    h.stub = services_pb2_grpc.BrokerStub(h.channel)
    yield h
    h.stop.set()
    await asyncio.wait_for(task, 30)
    await h.channel.close()
    await nc.close()


async def nats_connect(server: NatsServer) -> nats.aio.client.Client:
    return await nats.connect(server.url)


async def lease(h: Harness, num: int, timeout_s: float = 10.0) -> list[tuple[rollout_pb2.GenerationTask, object]]:
    """Lease ``num`` tasks the way generators do (the shared durable consumer)."""
    sub = await h.js.pull_subscribe(
        h.names.all_tasks, durable=h.names.generators_consumer, stream=h.names.tasks_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=60.0),
    )
    got: list[tuple[rollout_pb2.GenerationTask, object]] = []
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(got) < num and asyncio.get_running_loop().time() < deadline:
        try:
            msgs = await sub.fetch(batch=num - len(got), timeout=1.0)
        except asyncio.TimeoutError:
            continue
        got.extend((rollout_pb2.GenerationTask.FromString(m.data), m) for m in msgs)
    return got


async def publish_group(h: Harness, group: rollout_pb2.RolloutGroup) -> bool:
    ack = await h.js.publish(h.names.rollouts, group.SerializeToString(), headers={"Nats-Msg-Id": group.group_id})
    return bool(ack.duplicate)


async def next_batch(h: Harness, timeout_s: float = 10.0) -> tuple[services_pb2.BatchHeader, list[rollout_pb2.RolloutGroup]]:
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


async def test_back_pressure_batches_filters_and_acks(harness: Harness) -> None:
    h = harness
    # Back-pressure: with nothing consumed, at most `outstanding` train tasks exist.
    await asyncio.sleep(1.5)
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
    (t1, m1), (t2, m2), (t3, m3) = train[:3]
    assert not await publish_group(h, make_group(t1, [1.0, 0.0]))
    assert await publish_group(h, make_group(t1, [1.0, 0.0])), "a re-publish must be deduplicated"
    assert not await publish_group(h, make_group(t2, [0.0, 0.0]))  # zero variance
    assert not await publish_group(h, make_group(t3, [0.0, 1.0]))
    for _, m in train[:3]:
        await m.ack()  # type: ignore[attr-defined]

    header, groups = await next_batch(h)
    assert header.batch_id
    assert [g.group_id for g in groups] == [t1.task_id, t3.task_id]
    assert header.num_zero_variance == 1
    # Held until the learner acks: both groups are still in the stream.
    assert await stream_count(h, h.names.rollouts_stream) == 2
    resp = await h.stub.Ack(services_pb2.AckRequest(batch_ids=[header.batch_id, "nope"]))
    assert resp.num_acked == 2
    assert list(resp.unknown_batch_ids) == ["nope"]
    for _ in range(50):
        if await stream_count(h, h.names.rollouts_stream) == 0:
            break
        await asyncio.sleep(0.1)
    assert await stream_count(h, h.names.rollouts_stream) == 0

    status = await h.stub.Status(services_pb2.StatusRequest())
    assert status.gauges["groups_trained"] == 2
    assert status.gauges["dropped_zero_variance"] == 1


async def test_poison_is_dead_lettered_and_broker_keeps_serving(harness: Harness) -> None:
    h = harness
    await h.js.publish(h.names.rollouts, b"\xff\x00 not a protobuf", headers={"Nats-Msg-Id": "poison-1"})
    bad = rollout_pb2.RolloutGroup(group_id="bad-1", prompt_token_ids=[1], completions=[
        rollout_pb2.Completion(token_ids=[1, 2], logprobs=[-0.1], reward=1.0)])
    await h.js.publish(h.names.rollouts, bad.SerializeToString(), headers={"Nats-Msg-Id": "bad-1"})
    for _ in range(50):
        if await stream_count(h, h.names.deadletter_stream) >= 2:
            break
        await asyncio.sleep(0.1)
    assert await stream_count(h, h.names.deadletter_stream) == 2
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
