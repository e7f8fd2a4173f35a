"""The learner's gRPC face: Learner.PullWeights and Learner.Status."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from asymptote.codec import encode
from asymptote.contracts.v1 import services_pb2, services_pb2_grpc, tensors_pb2
from asymptote.health import Health
from services.learner.weights import WeightStore


class LearnerServicer(services_pb2_grpc.LearnerServicer):
    def __init__(
        self, store: WeightStore, health: Health, instance_id: str, gauges: Callable[[], dict[str, float]]
    ) -> None:
        self.store = store
        self.health = health
        self.instance_id = instance_id
        self.gauges = gauges

    async def PullWeights(
        self, request: services_pb2.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tensors_pb2.WeightsPart]:
        version = self.store.get(int(request.version))
        if version is None:
            newest = self.store.get(0)
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"version {request.version} is not held; newest is {newest.version if newest else 'none'}",
            )
            return
        for part in encode(version.version, version.tensors, version.sha256):
            yield part

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
