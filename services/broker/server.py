"""The broker's gRPC face: Broker.NextBatch, Broker.Ack, Broker.Status."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc
from asymptote.health import Health
from services.broker.pipeline import BrokerPipeline

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0
"""Longest a NextBatch call waits; the learner simply asks again."""
PACKED_PART_BYTES = 1 << 20
"""Groups per packed part stop short of this (gRPC's default receive limit is 4 MiB); a larger group goes alone."""


class BrokerServicer(services_pb2_grpc.BrokerServicer):
    def __init__(self, pipeline: BrokerPipeline, health: Health, instance_id: str) -> None:
        self.pipeline = pipeline
        self.health = health
        self.instance_id = instance_id

    async def NextBatch(
        self, request: services_pb2.NextBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[services_pb2.BatchPart]:
        batcher = self.pipeline.batcher
        num_groups = request.num_groups or self.pipeline.config.batch_prompts
        if num_groups > 4096:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_groups {num_groups} exceeds 4096")
        timeout_s = min(max(request.timeout_s, 0.0), MAX_WAIT_S)
        batch = await batcher.next_batch(int(request.learner_version), num_groups, timeout_s)
        self.pipeline.metrics.learner_version.set(batcher.learner_version)
        if batch is None:
            yield services_pb2.BatchPart(header=services_pb2.BatchHeader())
            return
        drops = batcher.take_counters()
        rollouts = batcher.take_rollout_counts()
        self.pipeline.metrics.groups_served.inc(len(batch.items))
        yield services_pb2.BatchPart(
            header=services_pb2.BatchHeader(
                batch_id=batch.batch_id,
                num_groups=len(batch.items),
                num_zero_variance=drops.get("zero_variance", 0),
                num_stale_dropped=drops.get("stale", 0),
                oldest_group_age_s=time.monotonic() - min(h.received_s for h in batch.items),
                num_completions=rollouts["completions"],
                num_interrupted=rollouts["interrupted"],
                num_truncated=rollouts["truncated"],
            )
        )
        if not request.packed:
            for held in batch.items:
                yield services_pb2.BatchPart(group=held.group)
            return
        part: list[rollout_pb2.RolloutGroup] = []
        part_bytes = 0
        for held in batch.items:
            size = held.group.ByteSize()
            if part and part_bytes + size > PACKED_PART_BYTES:
                yield services_pb2.BatchPart(groups=services_pb2.RolloutGroups(groups=part))
                part, part_bytes = [], 0
            part.append(held.group)
            part_bytes += size
        yield services_pb2.BatchPart(groups=services_pb2.RolloutGroups(groups=part))

    async def Ack(
        self, request: services_pb2.AckRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.AckResponse:
        batches: list[tuple[str, Sequence[str], Sequence[str]]] = [(b, (), ()) for b in request.batch_ids]
        batches += [(b.batch_id, list(b.group_ids), list(b.duplicate_group_ids)) for b in request.batches]
        num, unknown = await self.pipeline.batcher.ack(batches)
        self.pipeline.metrics.groups_trained.inc(num)
        if request.release_unacked:
            await self.pipeline.batcher.release()
        return services_pb2.AckResponse(num_acked=num, unknown_batch_ids=unknown)

    async def Status(
        self, request: services_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.ServiceStatus:
        p = self.pipeline
        b = p.batcher
        gauges = {
            "ready_groups": float(len(b.ready)),
            "handed_out_groups": float(sum(len(x.items) for x in b.handed_out.values())),
            "pending_tasks": float(p.pending_tasks),
            "groups_received": float(b.num_received),
            "groups_served": float(b.num_served),
            "groups_trained": float(b.num_trained),
            **{f"dropped_{k}": float(v) for k, v in b.dropped.items()},
        }
        if p.curriculum is not None:
            gauges["epoch"] = float(p.curriculum.state.epoch)
            gauges["tasks_issued"] = float(p.curriculum.state.num_issued)
        return services_pb2.ServiceStatus(
            service="broker",
            instance_id=self.instance_id,
            ready=self.health.ready,
            detail=self.health.detail,
            policy_version=b.learner_version,
            gauges=gauges,
        )
