"""The compute axis integrates telemetry over a changing number of generators."""

from __future__ import annotations

import pytest

from asymptote.contracts.v1 import rollout_pb2
from services.fitter.compute_axis import ComputeAxis


def report(instance: str, service: str, started: float, now: float, devices: int = 1) -> rollout_pb2.ComputeTelemetry:
    return rollout_pb2.ComputeTelemetry(
        service=service,
        instance_id=instance,
        num_devices=devices,
        device_seconds_total=(now - started) * devices,
        unix_s=now,
    )


def observe_fleet(axis: ComputeAxis, t: int) -> None:
    """The reports at time t of one generator and a 2-device learner from t=0, and two more
    generators from t=50, one of which dies after its report at t=80."""
    axis.observe(report("gen-a", "generator", 0, t))
    axis.observe(report("learner-0", "learner", 0, t, devices=2))
    if t >= 50:
        axis.observe(report("gen-b", "generator", 50, t))
    if 50 <= t <= 80:
        axis.observe(report("gen-c", "generator", 50, t))


def test_generators_joining_and_leaving_are_integrated_by_hand() -> None:
    axis = ComputeAxis(stale_s=5.0)
    # One generator and the learner (2 devices) from t=0; two more generators
    # join at t=50; one of them dies after its report at t=80. Reports every 10 s.
    for t in range(0, 101, 10):
        observe_fleet(axis, t)
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


def test_version_marks_integrate_devices_over_time_and_never_decrease() -> None:
    """Versions published between reports (every 10 s): the axis extrapolates live instances.

    Devices held: 1 generator + a 2-device learner (3) until t=50, then 2 more
    generators (5); one dies after its report at t=80 and is counted up to 95
    (its last report plus the 15 s stale allowance), then 4. By hand: 3 x 25 =
    75 at t=25; 150 + 5 x 5 = 175 at t=55; 150 + 5 x 45 = 375 at t=95; 375 +
    4 x 2 = 383 at t=97.
    """
    axis = ComputeAxis(stale_s=15.0)
    marks = {1: 25.0, 2: 55.0, 3: 95.0, 5: 97.0}
    for t in range(0, 121, 10):
        observe_fleet(axis, t)
        for version, published in marks.items():
            if t < published <= t + 10:
                axis.mark_version(version, published)
    assert [axis.at_version(v, 0.0) for v in (1, 2, 3, 5)] == pytest.approx([75.0, 175.0, 375.0, 383.0])
    # The mark of version 4 was missed; its eval finished at t=118, later than
    # version 5's publication. Its compute is held at version 5's, so the axis
    # never decreases with the version.
    assert axis.total(118.0) == pytest.approx(118 + 236 + 68 + 45)
    assert axis.at_version(4, 118.0) == axis.at_version(5, 0.0)
    values = [axis.at_version(v, 0.0) for v in (1, 2, 3, 4, 5)]
    assert values == sorted(values)


def test_a_mark_processed_late_gets_the_total_of_its_moment() -> None:
    """The policy watch can lag (e.g. after a NATS restart): reports newer than the
    publication are taken back to it, an instance not yet started counts zero."""
    axis = ComputeAxis(stale_s=5.0)
    axis.observe(report("gen-a", "generator", 0, 100))
    axis.observe(report("learner-0", "learner", 0, 100, devices=2))
    axis.observe(report("gen-b", "generator", 70, 100))
    axis.mark_version(3, 60.0)  # published at t=60, seen at t=100
    assert axis.at_version(3, 0.0) == pytest.approx(60 + 120 + 0)
    axis.mark_version(4, 80.0)
    assert axis.at_version(4, 0.0) == pytest.approx(80 + 160 + 10)


def test_eval_sampling_is_kept_off_the_axis_and_reported_apart() -> None:
    axis = ComputeAxis(stale_s=5.0)
    gen = report("gen-a", "generator", 0, 100)
    gen.eval_device_seconds_total = 30.0  # 30 of its 100 device-seconds sampled eval rounds
    axis.observe(gen)
    axis.observe(report("learner-0", "learner", 0, 100))
    assert axis.total(100.0) == pytest.approx(70 + 100)
    assert axis.total(102.0) == pytest.approx(72 + 102)  # extrapolated as training from the report on
    assert axis.total(50.0) == pytest.approx(20 + 50)  # taken back from the training part
    assert axis.eval_total() == pytest.approx(30.0)
    assert axis.by_service() == pytest.approx({"generator": 70, "learner": 100, "eval": 30})


def test_the_meter_splits_each_interval_by_its_tokens() -> None:
    """By hand: 10 device-seconds of 300 train and 100 eval tokens (2.5 s eval), then 10 of eval only
    (10 s), then 10 with no tokens (none); the total never decreases."""
    from asymptote.compute import ComputeMeter

    meter = ComputeMeter("generator", "gen-a", "cpu-core", 1)
    meter.add_tokens(300)
    meter.add_tokens(100, eval=True)
    assert meter._split_eval(10.0) == pytest.approx(2.5)
    meter.add_tokens(50, eval=True)
    assert meter._split_eval(20.0) == pytest.approx(12.5)
    assert meter._split_eval(30.0) == pytest.approx(12.5)
    meter.add_tokens(10)
    assert meter._split_eval(40.0) == pytest.approx(12.5)  # the idle interval went to training
    assert (meter.num_tokens, meter.num_eval_tokens) == (460, 150)
    fresh = ComputeMeter("generator", "gen-b", "cpu-core", 2)  # on the real clock: all of its time was eval
    fresh.add_tokens(5, eval=True)
    t = fresh.snapshot()
    assert t.eval_device_seconds_total == t.device_seconds_total > 0


def test_telemetry_claiming_more_eval_time_than_device_time_is_refused() -> None:
    from asymptote.errors import PayloadError
    from asymptote.messages import decode_telemetry

    bad = report("gen-a", "generator", 0, 10)
    bad.eval_device_seconds_total = 11.0
    with pytest.raises(PayloadError, match=r"eval_device_seconds_total 11\.0 exceeds device_seconds_total 10\.0"):
        decode_telemetry(bad.SerializeToString())
