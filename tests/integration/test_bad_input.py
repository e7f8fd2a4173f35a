"""Malformed bytes, out-of-range requests and oversized messages on every gRPC
method of the broker (with a real nats-server) and the learner's weight
server: each gets a gRPC status naming the problem, the servers stay up and
a good call afterwards still works."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from asymptote.codec import WireTensor
from asymptote.config import ListenSettings, NatsSettings
from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc
from asymptote.health import Health
from asymptote.jetstream.connect import connect
from asymptote.jetstream.names import Names, ensure_bucket
from asymptote.nats_local import NatsServer, free_port
from asymptote.policy import publish_policy
from asymptote.rpc import start_server
from asymptote.tasks import ArithmeticSettings
from services.broker.config import BrokerConfig, EvalSettings, SamplingSettings
from services.broker.main import serve
from services.learner.server import LearnerServicer, add_learner_to_server
from services.learner.weights import Version, WeightStore
from tests.helpers.badinput import send_bad_request, send_bad_requests

SEED = 8
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.INTERNAL,  # the request bytes did not deserialize
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # NextBatch waited for a batch that never came
}
ACK = "/asymptote.contracts.v1.Broker/Ack"
NEXT_BATCH = "/asymptote.contracts.v1.Broker/NextBatch"
PULL_WEIGHTS = "/asymptote.contracts.v1.Learner/PullWeights"
STREAM = {NEXT_BATCH, PULL_WEIGHTS}


@pytest.fixture
async def servers(nats: NatsServer) -> AsyncIterator[dict[str, int]]:
    prefix = "badinput"
    broker_port = free_port()
    config = BrokerConfig(
        nats=NatsSettings(url=nats.url),
        prefix=prefix,
        grpc={"port": broker_port},
        http={"port": free_port()},
        task=ArithmeticSettings(num_train=40, num_heldout=3, max_digits=2),
        sampling=SamplingSettings(group_size=2, max_tokens=4),
        eval=EvalSettings(every_versions=1000, num_samples=2),
        batch_prompts=2,
        max_outstanding_tasks=4,
        log_format="text",
    )
    stop = asyncio.Event()
    broker = asyncio.create_task(serve(config, stop))
    nc = await connect(NatsSettings(url=nats.url), "test")
    kv = await ensure_bucket(nc.jetstream(), Names(prefix).policy_bucket)
    await publish_policy(kv, Names(prefix), rollout_pb2.PolicyVersion(version=0, weights_endpoint="x:1", digest="00"))

    store = WeightStore({"w": ("float32", (4,))})
    store.put(Version(1, {"w": WireTensor.from_numpy(np.arange(4, dtype=np.float32))}, "00" * 32))
    health = Health("learner")
    learner, learner_port = await start_server(
        ListenSettings(host="127.0.0.1", port=0),
        health,
        lambda s: add_learner_to_server(LearnerServicer(store, health, "test", dict), s),
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


async def test_bad_requests_get_a_status_and_servers_stay_up(servers: dict[str, int]) -> None:
    rng = random.Random(SEED)
    broker_ch = grpc.aio.insecure_channel(f"127.0.0.1:{servers['broker']}")
    learner_ch = grpc.aio.insecure_channel(f"127.0.0.1:{servers['learner']}")
    valid = {
        ACK: services_pb2.AckRequest(
            batches=[services_pb2.AckedBatch(batch_id="b", group_ids=["g"])]
        ).SerializeToString(),
        "/asymptote.contracts.v1.Broker/Status": services_pb2.StatusRequest().SerializeToString(),
        NEXT_BATCH: services_pb2.NextBatchRequest(learner_version=3, num_groups=2, timeout_s=0.1).SerializeToString(),
        PULL_WEIGHTS: services_pb2.PullWeightsRequest(version=1).SerializeToString(),
        "/asymptote.contracts.v1.Learner/Status": services_pb2.StatusRequest().SerializeToString(),
    }
    sent: set[tuple[str, bytes]] = set()
    try:
        for method, good in valid.items():
            interface = "gRPC Broker" if "Broker" in method else "gRPC Learner"
            channel = broker_ch if "Broker" in method else learner_ch
            *answers, too_big = await send_bad_requests(
                channel, interface, method, good, rng, 40, streaming=method in STREAM
            )
            for answer in answers:
                # gRPC answers bytes that do not parse with UNKNOWN, naming the type and the error.
                assert answer.code in ALLOWED or answer.unparsable, (
                    method,
                    answer.request[:20],
                    answer.code,
                    answer.details,
                )
                assert answer.code == grpc.StatusCode.OK or answer.details, (method, answer.code)
            assert too_big.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (method, too_big.code, too_big.details)
            sent.update((method, a.request) for a in [*answers, too_big])

        # Out of range, named in the status.
        answer = await send_bad_request(
            broker_ch,
            "gRPC Broker",
            NEXT_BATCH,
            services_pb2.NextBatchRequest(num_groups=5000, timeout_s=0.1).SerializeToString(),
            streaming=True,
        )
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT and "num_groups" in answer.details
        answer = await send_bad_request(
            learner_ch,
            "gRPC Learner",
            PULL_WEIGHTS,
            services_pb2.PullWeightsRequest(version=999).SerializeToString(),
            streaming=True,
        )
        assert answer.code == grpc.StatusCode.NOT_FOUND and "999" in answer.details
        # Oversized: 5 MiB of group ids exceeds gRPC's 4 MiB receive limit.
        huge = services_pb2.AckRequest(batches=[services_pb2.AckedBatch(batch_id="x", group_ids=["g" * 1024] * 5120)])
        answer = await send_bad_request(broker_ch, "gRPC Broker", ACK, huge.SerializeToString())
        assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED

        broker = services_pb2_grpc.BrokerStub(broker_ch)
        learner = services_pb2_grpc.LearnerStub(learner_ch)
        # Still serving.
        status = await broker.Status(services_pb2.StatusRequest(), timeout=5)
        assert status.service == "broker"
        parts = [p async for p in learner.PullWeights(services_pb2.PullWeightsRequest(version=1), timeout=5)]
        assert parts[0].WhichOneof("part") == "header"
    finally:
        await broker_ch.close()
        await learner_ch.close()
    assert len(sent) >= 200
