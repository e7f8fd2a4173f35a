"""The broker's gRPC face: Broker.NextBatch, Broker.Ack, Broker.Status.

NextBatch sends each group in the bytes it arrived in from JetStream,
framed by hand (:mod:`asymptote.wire`) rather than copied into a message
and serialized again: the learner parses the same ``BatchPart`` either
way. Register it with :func:`add_broker_to_server`, not the generated
``add_BrokerServicer_to_server``, whose serializer expects messages.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from asymptote.contracts.v1 import services_pb2, services_pb2_grpc
from asymptote.health import Health
from asymptote.rpc import add_service
from asymptote.wire import length_delimited, length_delimited_key, varint
from services.broker.pipeline import BrokerPipeline

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0
"""Longest a NextBatch call waits; the learner simply asks again."""
PACKED_PART_BYTES = 1 << 20
"""Groups per packed part stop short of this (gRPC's default receive limit is 4 MiB); a larger group goes alone."""
_PART = services_pb2.BatchPart.DESCRIPTOR.fields_by_name
_GROUP_KEY = length_delimited_key(_PART["group"].number)
_GROUPS_KEY = length_delimited_key(_PART["groups"].number)
_ITEM_KEY = length_delimited_key(services_pb2.RolloutGroups.DESCRIPTOR.fields_by_name["groups"].number)
_DESCRIPTOR = services_pb2.DESCRIPTOR.services_by_name["Broker"]


class BrokerServicer(services_pb2_grpc.BrokerServicer):
    def __init__(self, pipeline: BrokerPipeline, health: Health, instance_id: str) -> None:
        self.pipeline = pipeline
        self.health = health
        self.instance_id = instance_id

    async def NextBatch(
        self, request: services_pb2.NextBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Serialized ``BatchPart``s: the header, then the groups (packed about 1 MiB a part if asked)."""
        batcher = self.pipeline.batcher
        num_groups = request.num_groups or self.pipeline.config.batch_prompts
        if num_groups > 4096:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_groups {num_groups} exceeds 4096")
        timeout_s = min(max(request.timeout_s, 0.0), MAX_WAIT_S)
        batch = await batcher.next_batch(int(request.learner_version), num_groups, timeout_s)
        self.pipeline.metrics.learner_version.set(batcher.learner_version)
        if batch is None:
            yield services_pb2.BatchPart(header=services_pb2.BatchHeader()).SerializeToString()
            return
        self.pipeline.metrics.groups_served.inc(len(batch.items))
        yield services_pb2.BatchPart(header=batcher.header(batch)).SerializeToString()
        for frame in group_frames([held.serialized() for held in batch.items], request.packed, PACKED_PART_BYTES):
            yield frame

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


def group_frames(groups: Sequence[bytes], packed: bool, part_bytes: int = PACKED_PART_BYTES) -> Iterator[bytes]:
    """Serialized ``BatchPart``s carrying ``groups`` (serialized ``RolloutGroup``s) in order.

    One group a part, or packed: consecutive groups in a ``RolloutGroups``
    part, each part stopping short of ``part_bytes`` (a larger group goes
    alone). The bytes are what ``SerializeToString`` of the same parts gives
    up to field order inside a group, which parsing does not see.
    """
    if not packed:
        for data in groups:
            yield length_delimited(_GROUP_KEY, data)
        return
    # A part's field is written around its groups' pieces in one join: each group's bytes are copied once.
    part: list[bytes] = []
    size = 0
    for data in groups:
        item = (_ITEM_KEY, varint(len(data)), data)
        item_size = sum(map(len, item))
        if part and size + item_size > part_bytes:
            yield b"".join((_GROUPS_KEY, varint(size), *part))
            part, size = [], 0
        part += item
        size += item_size
    if part:
        yield b"".join((_GROUPS_KEY, varint(size), *part))


def add_broker_to_server(servicer: BrokerServicer, server: grpc.aio.Server) -> None:
    """Register the Broker service; use instead of ``add_BrokerServicer_to_server`` (see the module docstring)."""
    add_service(server, _DESCRIPTOR, servicer, serialized=["NextBatch"])
