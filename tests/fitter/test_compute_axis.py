"""The compute axis integrates telemetry over a changing number of generators."""

from __future__ import annotations

import pytest

from asymptote.contracts.v1 import rollout_pb2
from services.fitter.compute_axis import ComputeAxis


def report(instance: str, service: str, started: float, now: float, devices: int = 1) -> rollout_pb2.ComputeTelemetry:
    return rollout_pb2.ComputeTelemetry(
        service=service, instance_id=instance, num_devices=devices,
        device_seconds_total=(now - started) * devices, unix_s=now,
    )


def test_generators_joining_and_leaving_are_integrated_by_hand() -> None:
    axis = ComputeAxis(stale_s=5.0)
    # One generator and the learner (2 devices) from t=0; two more generators
    # join at t=50; one of them dies after its report at t=80. Reports every 10 s.
    for t in range(0, 101, 10):
        axis.observe(report("gen-a", "generator", 0, t))
        axis.observe(report("learner-0", "learner", 0, t, devices=2))
        if t >= 50:
            axis.observe(report("gen-b", "generator", 50, t))
        if 50 <= t <= 80:
            axis.observe(report("gen-c", "generator", 50, t))
    # By hand at t=103: gen-a 103, learner 2 x 103, gen-b 53, gen-c 30 + 5 (stale allowance).
    assert axis.total(103.0) == pytest.approx(103 + 206 + 53 + 35)
    assert axis.by_service() == pytest.approx({"generator": 100 + 50 + 30, "learner": 200})
    # Out-of-order reports never shrink the total.
    axis.observe(report("gen-a", "generator", 0, 40))
    assert axis.total(100.0) == pytest.approx(100 + 200 + 50 + 35)
    # The x value of a version is the total when it was published, fixed once marked.
    axis.mark_version(7, 60.0)
    before = axis.at_version(7, 999.0)
    axis.observe(report("gen-a", "generator", 0, 110))
    assert axis.at_version(7, 999.0) == before
