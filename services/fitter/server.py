"""The fitter's gRPC face: Fitter.SubmitPoints and Fitter.GetProjection.

SubmitPoints fits points a client sends (e.g. another run, for a recipe
comparison) under its own run name; the first point with policy_version 0
is R0. GetProjection returns the live run's projection, or a submitted
run's by name.
"""

from __future__ import annotations

import math

import grpc
import numpy as np

from asymptote.contracts.v1 import services_pb2, services_pb2_grpc
from services.fitter.collector import Collector, fit_projection

MAX_POINTS = 100_000


class FitterServicer(services_pb2_grpc.FitterServicer):
    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.submitted: dict[str, services_pb2.Projection] = {}

    async def SubmitPoints(
        self, request: services_pb2.SubmitPointsRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.Projection:
        pts = list(request.points)
        if not request.run:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "run name is empty")
        if not 0 < len(pts) <= MAX_POINTS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"send 1 to {MAX_POINTS} points, got {len(pts)}")
        bad = [i for i, p in enumerate(pts) if not (math.isfinite(p.compute) and math.isfinite(p.pass_rate))]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"points {bad[:5]} hold NaN or Inf")
        base = [p for p in pts if p.policy_version == 0]
        if not base:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no point with policy_version 0 (R0)")
        rest = [p for p in pts if p.policy_version > 0]
        proj, _ = fit_projection(
            np.array([p.compute for p in rest]), np.array([p.pass_rate for p in rest]), base[0].pass_rate,
            self.collector.settings, self.collector.target_multiples,
        )
        self.submitted[request.run] = proj
        return proj

    async def GetProjection(
        self, request: services_pb2.GetProjectionRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.Projection:
        if request.run and request.run != self.collector.run_name:
            if request.run not in self.submitted:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no run named {request.run!r}")
            return self.submitted[request.run]
        return self.collector.projection
