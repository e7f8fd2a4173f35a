"""The learner's gRPC face: Learner.PullWeights and Learner.Status.

``add_learner_to_server`` registers them: Status as the generated code
would, PullWeights with a response serializer that passes bytes through,
because the servicer yields each ``WeightsPart`` already serialized
(``asymptote.codec.encode_frames``): a chunk's bytes are copied once into
its frame instead of into a message and again into its serialization.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from asymptote.codec import encode_frames
from asymptote.contracts.v1 import services_pb2, services_pb2_grpc
from asymptote.health import Health
from asymptote.rpc import add_service, reuse_freed_message_buffers
from services.learner.weights import WeightStore

_DESCRIPTOR = services_pb2.DESCRIPTOR.services_by_name["Learner"]


class LearnerServicer(services_pb2_grpc.LearnerServicer):
    def __init__(
        self, store: WeightStore, health: Health, instance_id: str, gauges: Callable[[], dict[str, float]]
    ) -> None:
        self.store = store
        self.health = health
        self.instance_id = instance_id
        self.gauges = gauges
        reuse_freed_message_buffers()  # every frame served is a chunk-sized buffer, allocated and freed

    async def PullWeights(
        self, request: services_pb2.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """A held version as serialized ``WeightsPart`` frames; NOT_FOUND if it is not held.

        Its changes since ``request.base_version`` when that version (with
        ``request.base_digest``) is held too, else the whole version.
        """
        version = self.store.get(int(request.version))
        if version is None:
            newest = self.store.get(0)
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"version {request.version} is not held; newest is {newest.version if newest else 'none'}",
            )
            return
        frames = None
        if request.base_version:
            frames = await asyncio.to_thread(
                self.store.delta, version.version, int(request.base_version), request.base_digest
            )
        for frame in frames or encode_frames(version.version, version.tensors, version.digest):
            yield frame

    async def Status(
        self, request: services_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.ServiceStatus:
        newest = self.store.get(0)
        return services_pb2.ServiceStatus(
            service="learner",
            instance_id=self.instance_id,
            ready=self.health.ready,
            detail=self.health.detail,
            policy_version=newest.version if newest else 0,
            gauges=self.gauges(),
        )


def add_learner_to_server(servicer: LearnerServicer, server: grpc.aio.Server) -> None:
    """Register the Learner service; use instead of ``add_LearnerServicer_to_server`` (see the module docstring)."""
    add_service(server, _DESCRIPTOR, servicer, serialized=["PullWeights"])
