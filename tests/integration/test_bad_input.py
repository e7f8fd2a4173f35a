"""Malformed bytes, out-of-range requests and oversized messages on every gRPC
method of the broker (with a real nats-server) and the learner's weight
server: each gets a gRPC status naming the problem, the servers stay up and
a good call afterwards still works."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from asymptote.codec import WireTensor
from asymptote.config import ListenSettings, NatsSettings
from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc
from asymptote.health import Health
from asymptote.nats_local import NatsServer, free_port
from asymptote.policy import publish_policy
from asymptote.rpc import start_server
from asymptote.streams import Names, connect, ensure_bucket
from asymptote.tasks import TaskSettings
from services.broker.config import BrokerConfig, EvalSettings, SamplingSettings
from services.broker.main import serve
from services.learner.server import LearnerServicer, add_learner_to_server
from services.learner.weights import Version, WeightStore

SEED = 8
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.INTERNAL,  # the request bytes did not deserialize
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # NextBatch waited for a batch that never came
}
UNARY = {"/asymptote.contracts.v1.Broker/Ack", "/asymptote.contracts.v1.Broker/Status",
         "/asymptote.contracts.v1.Learner/Status"}
STREAM = {"/asymptote.contracts.v1.Broker/NextBatch", "/asymptote.contracts.v1.Learner/PullWeights"}


def payloads(rng: random.Random, valid: bytes, n: int) -> list[bytes]:
    """Random bytes, truncations and bit flips of a valid request."""
    out = [b"\xff", b"\x0a\xff\xff\xff\xff\x0f", valid[: len(valid) // 2]]
    while len(out) < n:
        kind = rng.random()
        if kind < 0.4:
            out.append(rng.randbytes(rng.randint(1, 200)))
        elif kind < 0.8 and valid:
            b = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            out.append(bytes(b))
        else:
            out.append(b"\x08" + rng.randbytes(rng.randint(0, 12)))
    return out


@pytest.fixture
async def servers(nats: NatsServer) -> AsyncIterator[dict[str, int]]:
    prefix = "badinput"
    broker_port = free_port()
    config = BrokerConfig(
        nats=NatsSettings(url=nats.url), prefix=prefix, grpc={"port": broker_port}, http={"port": free_port()},
        task=TaskSettings(num_train=40, num_heldout=3, max_digits=2),
        sampling=SamplingSettings(group_size=2, max_tokens=4), eval=EvalSettings(every_versions=1000, num_samples=2),
        batch_prompts=2, max_outstanding_tasks=4, log_format="text",
    )
    stop = asyncio.Event()
    broker = asyncio.create_task(serve(config, stop))
    nc = await connect(NatsSettings(url=nats.url), "test")
    kv = await ensure_bucket(nc.jetstream(), Names(prefix).policy_bucket)
    await publish_policy(kv, Names(prefix), rollout_pb2.PolicyVersion(version=0, weights_endpoint="x:1", sha256="00"))

    store = WeightStore({"w": ("float32", (4,))})
    store.put(Version(1, {"w": WireTensor.from_numpy(np.arange(4, dtype=np.float32))}, "00" * 32))
    health = Health("learner")
    learner, learner_port = await start_server(
        ListenSettings(host="127.0.0.1", port=0), health,
        lambda s: add_learner_to_server(
            LearnerServicer(store, health, "test", lambda: {}), s),
        ["asymptote.contracts.v1.Learner"],
    )
    await health.unblock("starting")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{broker_port}") as ch:  # wait for the broker to serve
        await services_pb2_grpc.BrokerStub(ch).Status(services_pb2.StatusRequest(), timeout=30, wait_for_ready=True)
    try:
        yield {"broker": broker_port, "learner": learner_port}
    finally:
        stop.set()
        await asyncio.wait_for(broker, 30)
        await learner.stop(None)
        await nc.close()


async def call_raw(channel: grpc.aio.Channel, method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    ident = lambda x: x  # noqa: E731
    try:
        if method in STREAM:
            call = channel.unary_stream(method, request_serializer=ident, response_deserializer=ident)
            async for _ in call(data, timeout=2.0):
                pass
        else:
            await channel.unary_unary(method, request_serializer=ident, response_deserializer=ident)(data, timeout=2.0)
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as exc:
        return exc.code(), str(exc.details())


async def test_bad_requests_get_a_status_and_servers_stay_up(servers: dict[str, int]) -> None:
    rng = random.Random(SEED)
    broker_ch = grpc.aio.insecure_channel(f"127.0.0.1:{servers['broker']}")
    learner_ch = grpc.aio.insecure_channel(f"127.0.0.1:{servers['learner']}")
    valid = {
        "/asymptote.contracts.v1.Broker/Ack": services_pb2.AckRequest(
            batches=[services_pb2.AckedBatch(batch_id="b", group_ids=["g"])]).SerializeToString(),
        "/asymptote.contracts.v1.Broker/Status": services_pb2.StatusRequest().SerializeToString(),
        "/asymptote.contracts.v1.Broker/NextBatch": services_pb2.NextBatchRequest(
            learner_version=3, num_groups=2, timeout_s=0.1).SerializeToString(),
        "/asymptote.contracts.v1.Learner/PullWeights": services_pb2.PullWeightsRequest(version=1).SerializeToString(),
        "/asymptote.contracts.v1.Learner/Status": services_pb2.StatusRequest().SerializeToString(),
    }
    tried: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    try:
        for method, good in valid.items():
            channel = broker_ch if "Broker" in method else learner_ch
            for data in payloads(rng, good, 40):
                code, details = await call_raw(channel, method, data)
                # gRPC answers bytes that do not parse with UNKNOWN, naming the type and the error.
                unparsable = code == grpc.StatusCode.UNKNOWN and "Error parsing message with type" in details
                assert code in ALLOWED or unparsable, (
                    method, data[:20], code, details)
                tried[method] += 1
                codes[code.name] += 1

        broker = services_pb2_grpc.BrokerStub(broker_ch)
        learner = services_pb2_grpc.LearnerStub(learner_ch)
        # Out of range, named in the status.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in broker.NextBatch(services_pb2.NextBatchRequest(num_groups=5000, timeout_s=0.1)):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_groups" in str(err.value.details())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in learner.PullWeights(services_pb2.PullWeightsRequest(version=999)):
                pass
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "999" in str(err.value.details())
        # Oversized: 5 MiB of group ids exceeds gRPC's 4 MiB receive limit.
        huge = services_pb2.AckRequest(batches=[services_pb2.AckedBatch(batch_id="x", group_ids=["g" * 1024] * 5120)])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await broker.Ack(huge)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        tried["explicit"] += 3

        # Still serving.
        status = await broker.Status(services_pb2.StatusRequest(), timeout=5)
        assert status.service == "broker"
        parts = [p async for p in learner.PullWeights(services_pb2.PullWeightsRequest(version=1), timeout=5)]
        assert parts[0].WhichOneof("part") == "header"
    finally:
        await broker_ch.close()
        await learner_ch.close()
    print("bad gRPC inputs tried:", dict(tried), "total", sum(tried.values()), "status codes:", dict(codes))
    assert sum(tried.values()) >= 200
