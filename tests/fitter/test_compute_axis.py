"""The compute axis: FLOPs counted from tokens (the same tokens give the same compute however long they
took), and device-seconds held integrated over a changing number of generators (the run's cost)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asymptote.contracts.v1 import rollout_pb2
from services.fitter.compute_axis import ComputeAxis
from services.fitter.curve import CurveFitSettings


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
    assert axis.device_seconds(103.0) == pytest.approx(103 + 206 + 53 + 35)
    assert axis.by_service() == pytest.approx({"generator": 100 + 50 + 30, "learner": 200})
    # Out-of-order reports never shrink the total.
    axis.observe(report("gen-a", "generator", 0, 40))
    assert axis.device_seconds(100.0) == pytest.approx(100 + 200 + 50 + 35)
    # The x value of a version is the total when it was published, fixed once marked.
    axis.mark_version(7, 60.0)
    before = axis.at_version(7, 999.0).device_seconds
    axis.observe(report("gen-a", "generator", 0, 110))
    assert axis.at_version(7, 999.0).device_seconds == before


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
    assert [axis.at_version(v, 0.0).device_seconds for v in (1, 2, 3, 5)] == pytest.approx([75.0, 175.0, 375.0, 383.0])
    # The mark of version 4 was missed; its eval finished at t=118, later than
    # version 5's publication. Its compute is held at version 5's, so the axis
    # never decreases with the version.
    assert axis.device_seconds(118.0) == pytest.approx(118 + 236 + 68 + 45)
    assert axis.at_version(4, 118.0) == axis.at_version(5, 0.0)
    values = [axis.at_version(v, 0.0).device_seconds for v in (1, 2, 3, 4, 5)]
    assert values == sorted(values)


def test_a_mark_processed_late_gets_the_total_of_its_moment() -> None:
    """The policy watch can lag (e.g. after a NATS restart): reports newer than the
    publication are taken back to it, an instance not yet started counts zero."""
    axis = ComputeAxis(stale_s=5.0)
    axis.observe(report("gen-a", "generator", 0, 100))
    axis.observe(report("learner-0", "learner", 0, 100, devices=2))
    axis.observe(report("gen-b", "generator", 70, 100))
    axis.mark_version(3, 60.0)  # published at t=60, seen at t=100
    assert axis.at_version(3, 0.0).device_seconds == pytest.approx(60 + 120 + 0)
    axis.mark_version(4, 80.0)
    assert axis.at_version(4, 0.0).device_seconds == pytest.approx(80 + 160 + 10)


def test_eval_sampling_is_kept_off_the_axis_and_reported_apart() -> None:
    axis = ComputeAxis(stale_s=5.0)
    gen = report("gen-a", "generator", 0, 100)
    gen.eval_device_seconds_total = 30.0  # 30 of its 100 device-seconds sampled eval rounds
    axis.observe(gen)
    axis.observe(report("learner-0", "learner", 0, 100))
    assert axis.device_seconds(100.0) == pytest.approx(70 + 100)
    assert axis.device_seconds(102.0) == pytest.approx(72 + 102)  # extrapolated as training from the report on
    assert axis.device_seconds(50.0) == pytest.approx(20 + 50)  # taken back from the training part
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


def flops_report(
    instance: str, service: str, now: float, flops: float, eval_flops: float = 0.0
) -> rollout_pb2.ComputeTelemetry:
    """A report whose FLOPs were counted from tokens; its device-seconds are whatever the clock gave."""
    return rollout_pb2.ComputeTelemetry(
        service=service,
        instance_id=instance,
        num_devices=1,
        device_seconds_total=now,
        unix_s=now,
        flops_total=flops,
        eval_flops_total=eval_flops,
        num_params=1000,
    )


def replay_run(seconds_per_step: list[float]) -> list[tuple[float, float]]:
    """A run of 30 learner steps with the step times given (the machine's load). Every step the learner trains
    2,000 tokens and reports as it announces the new version (``ComputeMeter.publish_version``); the generator
    samples 2,500 tokens a step (500 of them eval), at an even pace through the step, and reports every 2 s of
    wall time. The policy watch sees each version before the learner's report of it. Each tenth version's
    (FLOPs, device-seconds), read when its eval round would finish (after the reports of that moment)."""
    axis = ComputeAxis(stale_s=30.0)
    n = 1000
    ends = [sum(seconds_per_step[: i + 1]) for i in range(len(seconds_per_step))]

    def generated(t: float) -> float:
        """Steps' worth of generation by time t: the steps done and the done part of the current one."""
        done = sum(1 for end in ends if end <= t)
        if done == len(ends):
            return float(done)
        begun = ends[done - 1] if done else 0.0
        return done + (t - begun) / (ends[done] - begun)

    events = [(end, "version", v) for v, end in enumerate(ends, start=1)]
    events += [(2.0 * k, "generator", 0) for k in range(int(ends[-1] // 2.0) + 2)]
    for t, kind, version in sorted(events):
        if kind == "version":
            axis.mark_version(version, t)
            axis.observe(flops_report("learner-0", "learner", t, 6 * n * 2000 * version))
        else:
            steps = generated(t)
            axis.observe(flops_report("gen-0", "generator", t, 2 * n * 2500 * steps, 2 * n * 500 * steps))
    return [tuple(axis.at_version(v, 0.0)) for v in range(10, 31, 10)]  # type: ignore[misc]


def test_the_same_tokens_give_the_same_compute_whatever_the_timing() -> None:
    """The issue's acceptance, in miniature: one recipe, the same tokens per step, run on a quiet machine (1 s a
    step), three times slower throughout, and beside a neighbour that slows it irregularly (2 to 7 s a step).
    The FLOPs at each eval version are those of the tokens (the learner's exactly, the generator's to within its
    reports' interpolation); the device-seconds held, the axis before, stretch with the load."""
    quiet = replay_run([1.0] * 30)
    slower = replay_run([3.0] * 30)
    loaded = replay_run([2.0 + 5.0 * ((7 * i) % 11) / 10 for i in range(30)])
    # By hand at version 10: (6 x 2,000 learner + 2 x 2,000 generator train tokens) x N x 10 steps.
    assert quiet[0][0] == pytest.approx((6 * 2000 + 2 * 2000) * 1000 * 10)
    assert [q[0] for q in slower] == pytest.approx([q[0] for q in quiet], rel=1e-12)
    assert [x[0] for x in loaded] == pytest.approx([q[0] for q in quiet], rel=0.01)
    held_ratio = [x[1] / q[1] for q, x in zip(quiet, loaded)]
    assert min(held_ratio) > 3.0  # the same work, held three to five times as long


def test_flops_between_reports_are_interpolated_and_carried_on_after_the_last() -> None:
    axis = ComputeAxis(stale_s=5.0)
    axis.observe(flops_report("gen-0", "generator", 10.0, 100.0))
    axis.observe(flops_report("gen-0", "generator", 20.0, 300.0, eval_flops=100.0))
    assert axis.flops(15.0) == pytest.approx(150.0)  # halfway between 100 and 200 training FLOPs
    assert axis.flops(22.0) == pytest.approx(200.0 + 10.0 * 2.0)  # at the last interval's 10 FLOPs/s
    assert axis.flops(40.0) == pytest.approx(200.0 + 10.0 * 5.0)  # for at most stale_s (5 s, below the 10 s)
    assert axis.flops(5.0) == pytest.approx(50.0) and axis.flops(0.0) == 0.0  # taken back, never below 0
    assert axis.flops_by_service() == {"generator": 200.0, "eval": 100.0}
    assert axis.num_params() == {"generator": 1000}


def test_the_meter_counts_flops_from_tokens() -> None:
    """2N a token a generator processed (eval's apart), 6N a token trained, 2N for a step with an empty loss."""
    from asymptote.compute import ComputeMeter

    gen = ComputeMeter("generator", "gen-a", "cpu-core", 1, num_params=1000)
    gen.add_tokens(300, num_processed=350)  # 300 sampled of a 50-token prompt
    gen.add_tokens(100, eval=True, num_processed=120)
    assert (gen.flops, gen.eval_flops) == (2 * 1000 * 470, 2 * 1000 * 120)
    learner = ComputeMeter("learner", "l", "cpu-core", 1, num_params=1000)
    learner.add_trained(400)
    learner.add_trained(100, backward=False)
    t = learner.snapshot()
    assert (t.flops_total, t.num_params) == (6 * 1000 * 400 + 2 * 1000 * 100, 1000)


def test_flop_params_reads_the_safetensors_headers(tmp_path: Path) -> None:
    """N: every weight but the input embedding lookup, with a tied head counted once as the embedding."""
    import json
    import struct

    from asymptote.compute import flop_params

    def write(path: Path, shapes: dict[str, list[int]]) -> None:
        header = {name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]} for name, shape in shapes.items()}
        raw = json.dumps({**header, "__metadata__": {"format": "pt"}}).encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw)

    layers = {"model.layers.0.mlp.up_proj.weight": [256, 128], "model.norm.weight": [128]}
    tied = tmp_path / "tied"
    tied.mkdir()
    write(tied / "model.safetensors", {"model.embed_tokens.weight": [512, 128], **layers})
    assert flop_params(tied) == 256 * 128 + 128 + 512 * 128
    untied = tmp_path / "untied"
    untied.mkdir()
    write(untied / "model-00001-of-00002.safetensors", {"model.embed_tokens.weight": [512, 128], **layers})
    write(untied / "model-00002-of-00002.safetensors", {"lm_head.weight": [512, 128]})
    assert flop_params(untied) == 256 * 128 + 128 + 512 * 128
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    write(gpt2 / "model.safetensors", {"transformer.wte.weight": [512, 64], "transformer.wpe.weight": [1024, 64],
                                       "transformer.h.0.mlp.c_fc.weight": [64, 256]})  # fmt: skip
    assert flop_params(gpt2) == 64 * 256 + 512 * 64
    assert flop_params(tmp_path) == 0  # no safetensors: no FLOPs counted


def test_telemetry_claiming_more_eval_flops_than_flops_is_refused() -> None:
    from asymptote.errors import PayloadError
    from asymptote.messages import decode_telemetry

    bad = flops_report("gen-a", "generator", 10.0, 100.0, eval_flops=101.0)
    with pytest.raises(PayloadError, match="eval_flops_total 101 exceeds flops_total 100"):
        decode_telemetry(bad.SerializeToString())


def test_a_run_whose_services_count_no_flops_says_why_instead_of_fitting_zeros(tmp_path: Path) -> None:
    """A model directory without safetensors weights gives N = 0: the curve's compute would be 0 throughout."""
    from services.fitter.collector import Collector

    axis = ComputeAxis(stale_s=30.0)
    collector = Collector(tmp_path, "no-flops", CurveFitSettings(num_bootstrap_resamples=20), (2.0,), axis, plot=False)
    for version in range(0, 60, 10):
        axis.observe(report("gen-0", "generator", 0, version))  # device time held, no FLOPs: N was 0
        axis.mark_version(version, float(version))
        result = rollout_pb2.EvalResult(
            eval_id=f"e{version}", task_id=f"e{version}-0", prompt_id="p", num_samples=4, num_correct=1 + version // 20,
            eval_version=version, min_version=version, max_version=version, eval_num_prompts=1,
            finished_unix_s=float(version), tokens_by_version={version: 10},
        )  # fmt: skip
        collector.add_result(result)
    fit = collector.projection
    assert not fit.ok and fit.reason.startswith("no FLOPs counted (N by service: {'generator': 0}): the model")
    assert fit.reason.endswith("or set the fitter's compute_axis: device_seconds")
