"""The fitter's gRPC face: Fitter.SubmitPoints and Fitter.GetProjection.

SubmitPoints fits points a client sends (e.g. another run, for a recipe
comparison) under its own run name; the point with policy_version 0 is R0.
GetProjection returns the live run's projection, or a submitted run's by
name.

Two kinds of refusal: a request no run can produce (a NaN or infinite
value, negative compute, a pass rate outside [0, 1], a repeated
policy_version, compute that decreases as policy_version grows, no R0
point) is INVALID_ARGUMENT with a message naming the field, e.g.
``points[4].pass_rate``; valid points that cannot support a fit (too few
after the early cutoff, constant pass rates, no gain over R0) return a
Projection with ``ok=false`` and the reason, as the live run's projection
does before it has enough points. Either way the service keeps serving.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Sequence
from itertools import pairwise

import grpc
import numpy as np

from asymptote.contracts.v1 import services_pb2, services_pb2_grpc
from services.fitter.collector import Collector, RunCollectors, fit_projection

MAX_POINTS = 100_000
MAX_RUN_NAME_CHARS = 200
# Submitted runs kept for GetProjection; the oldest is forgotten beyond this.
MAX_SUBMITTED_RUNS = 256


def check_points(points: Sequence[services_pb2.CurvePoint]) -> str | None:
    """What is wrong with submitted points (naming the field), or None when they can be fitted."""
    if not 0 < len(points) <= MAX_POINTS:
        return f"points: send 1 to {MAX_POINTS} points, got {len(points)}"
    seen: dict[int, int] = {}
    for i, point in enumerate(points):
        if not (math.isfinite(point.compute) and point.compute >= 0):
            return (
                f"points[{i}].compute is {point.compute}: must be a finite number >= 0 (cumulative accelerator-seconds)"
            )
        if not (math.isfinite(point.pass_rate) and 0.0 <= point.pass_rate <= 1.0):
            return f"points[{i}].pass_rate is {point.pass_rate}: must be a finite number in [0, 1]"
        if point.policy_version > 0 and point.compute == 0:
            return (
                f"points[{i}].compute is 0 at policy_version {point.policy_version}: points after R0 need compute > 0"
            )
        if point.policy_version in seen:
            return (
                f"points[{i}].policy_version {point.policy_version} repeats points[{seen[point.policy_version]}]'s; "
                "send one point per policy version"
            )
        seen[point.policy_version] = i
    if 0 not in seen:
        return "points: no point with policy_version 0 (R0, the pass rate before RL)"
    order = sorted(seen)
    for before, after in pairwise(order):
        i, j = seen[before], seen[after]
        if points[j].compute < points[i].compute:
            return (
                f"points[{j}].compute {points[j].compute:g} (policy_version {after}) is below points[{i}].compute "
                f"{points[i].compute:g} (policy_version {before}): cumulative compute must not decrease as "
                "policy_version grows"
            )
    return None


class FitterServicer(services_pb2_grpc.FitterServicer):
    """Serves the live run's projection (a mixture's: each sub-task's, as ``run/sub-task``) and fits
    submitted runs."""

    def __init__(self, collector: Collector | RunCollectors) -> None:
        self.collector = collector
        self.submitted: OrderedDict[str, services_pb2.Projection] = OrderedDict()

    async def SubmitPoints(
        self, request: services_pb2.SubmitPointsRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.Projection:
        if not request.run or len(request.run) > MAX_RUN_NAME_CHARS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"run: give a name of 1 to {MAX_RUN_NAME_CHARS} characters"
            )
        if request.run in (self.collector.run_name, *(name for name, _ in self.collector.series())):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"run: {request.run!r} is the live run's name; choose another"
            )
        points = list(request.points)
        problem = check_points(points)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        ordered = sorted(points, key=lambda point: point.policy_version)
        r0, rest = ordered[0].pass_rate, ordered[1:]
        # A fit with its bootstrap takes up to seconds on many points: off the event loop.
        projection, _ = await asyncio.to_thread(
            fit_projection,
            np.array([point.compute for point in rest]),
            np.array([point.pass_rate for point in rest]),
            r0,
            self.collector.settings,
            self.collector.target_multiples,
            self.collector.planned_compute,
        )
        self.submitted[request.run] = projection
        self.submitted.move_to_end(request.run)
        while len(self.submitted) > MAX_SUBMITTED_RUNS:
            self.submitted.popitem(last=False)
        return projection

    async def GetProjection(
        self, request: services_pb2.GetProjectionRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.Projection:
        live = dict(self.collector.series())
        if request.run in live or (not request.run and self.collector.run_name in live):
            return live[request.run or self.collector.run_name].projection
        if not request.run or request.run == self.collector.run_name:
            curves = ", ".join(live)
            return services_pb2.Projection(ok=False, reason=f"a mixture of tasks: ask for each curve ({curves})")
        if request.run not in self.submitted:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"run: no run named {request.run!r}")
        return self.submitted[request.run]
