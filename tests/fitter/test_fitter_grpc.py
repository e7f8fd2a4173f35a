"""The Fitter gRPC service over a real channel and the Prometheus collector.

Submit points and read the projection with intervals; the live run's
projection built from eval results through the collector; bad points get
INVALID_ARGUMENT naming the field, malformed and oversized requests on both
methods a status naming the problem, and the service keeps answering; every
scrape sees one fit, even while refits run concurrently.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asymptote.config import ListenSettings
from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc
from asymptote.health import Health
from asymptote.rpc import start_server
from services.fitter.collector import Collector, Point, load_points
from services.fitter.compute_axis import ComputeAxis
from services.fitter.curve import CurveFitSettings, predict
from services.fitter.holdout import project_from_half
from services.fitter.metrics import ProjectionCollector, registry_with
from services.fitter.server import FitterServicer
from tests.helpers.badinput import send_bad_request, send_bad_requests
from tests.helpers.fitcheck import eval_round
from tests.helpers.waiting import wait_until

A, B, C_MID, R0 = 0.61, 1.92, 2542.0, 0.2
SETTINGS = CurveFitSettings(num_bootstrap_resamples=50)
Fitter = tuple[services_pb2_grpc.FitterStub, grpc.aio.Channel, Collector]
SUBMIT_POINTS = "/asymptote.contracts.v1.Fitter/SubmitPoints"
GET_PROJECTION = "/asymptote.contracts.v1.Fitter/GetProjection"


def points(n: int = 30) -> list[services_pb2.CurvePoint]:
    compute = np.linspace(0.0, 2 * C_MID, n)
    rate = predict(np.maximum(compute, 1e-9), A, B, C_MID, R0)
    return [
        services_pb2.CurvePoint(compute=float(c), pass_rate=float(r), policy_version=i)
        for i, (c, r) in enumerate(zip(compute, rate))
    ]


@pytest.fixture
async def fitter(tmp_path: Path) -> AsyncIterator[Fitter]:
    collector = Collector(tmp_path, "live", SETTINGS, (2.0,), ComputeAxis(30.0), plot=False)
    health = Health("fitter")
    server, port = await start_server(
        ListenSettings(host="127.0.0.1", port=0),
        health,
        lambda s: services_pb2_grpc.add_FitterServicer_to_server(FitterServicer(collector), s),
        ["asymptote.contracts.v1.Fitter"],
    )
    await health.unblock("starting")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield services_pb2_grpc.FitterStub(channel), channel, collector
    finally:
        await server.stop(None)


async def test_submit_points_and_read_the_projection_with_intervals(fitter: Fitter) -> None:
    """The fit's input is known: noiseless points on the paper's 8B curve (``points()``)."""
    stub, _, _ = fitter
    proj = await stub.SubmitPoints(services_pb2.SubmitPointsRequest(run="ablation-1", points=points()))
    assert proj.ok, proj.reason
    # Noiseless points from the paper's curve: the fit recovers its parameters.
    assert proj.a == pytest.approx(A, abs=1e-4) and proj.b == pytest.approx(B, rel=1e-3)
    assert proj.c_mid == pytest.approx(C_MID, rel=1e-3)
    assert proj.r0 == pytest.approx(R0)
    assert proj.a_interval.low <= proj.a <= proj.a_interval.high
    assert proj.a_interval.high - proj.a_interval.low < 1e-3
    # Curve points k * 2 C_mid / 29 (k = 1..29), all at or above the default cutoff at compute 0.
    assert proj.num_points_used == 29
    assert proj.identifiable and list(proj.at_bound) == []
    (projected,) = proj.projections
    assert projected.compute == pytest.approx(4 * C_MID)  # 2 x the largest compute
    assert projected.pass_rate == pytest.approx(float(predict(4 * C_MID, A, B, C_MID, R0)), abs=1e-4)
    assert projected.interval.low <= projected.pass_rate <= projected.interval.high
    again = await stub.GetProjection(services_pb2.GetProjectionRequest(run="ablation-1"))
    assert again == proj

    # Order does not matter: points are taken in policy_version order.
    shuffled = points()
    random.Random(0).shuffle(shuffled)
    other = await stub.SubmitPoints(services_pb2.SubmitPointsRequest(run="shuffled", points=shuffled))
    assert (other.a, other.b, other.c_mid) == (proj.a, proj.b, proj.c_mid)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetProjection(services_pb2.GetProjectionRequest(run="nobody"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nobody" in err.value.details()


def _bad(case: str) -> tuple[services_pb2.SubmitPointsRequest, str]:
    """A request with one kind of bad input, and the start of the message it must get."""
    pts = points()
    run = "bad"
    if case == "nan_pass_rate":
        pts[4].pass_rate = float("nan")
        expected = "points[4].pass_rate is nan: must be a finite number in [0, 1]"
    elif case == "inf_compute":
        pts[2].compute = float("inf")
        expected = "points[2].compute is inf: must be a finite number >= 0"
    elif case == "negative_compute":
        pts[3].compute = -1.0
        expected = "points[3].compute is -1.0: must be a finite number >= 0"
    elif case == "pass_rate_above_one":
        pts[5].pass_rate = 1.5
        expected = "points[5].pass_rate is 1.5: must be a finite number in [0, 1]"
    elif case == "r0_outside":
        pts[0].pass_rate = -0.1
        expected = "points[0].pass_rate is -0.1: must be a finite number in [0, 1]"
    elif case == "zero_compute_after_r0":
        pts[3].compute = 0.0
        expected = "points[3].compute is 0 at policy_version 3: points after R0 need compute > 0"
    elif case == "repeated_version":
        pts[6].policy_version = 5
        expected = "points[6].policy_version 5 repeats points[5]'s"
    elif case == "decreasing_compute":
        pts[8].compute = pts[7].compute - 1.0
        expected = f"points[8].compute {pts[8].compute:g} (policy_version 8) is below points[7].compute"
    elif case == "no_r0":
        pts = pts[1:]
        expected = "points: no point with policy_version 0 (R0"
    elif case == "no_points":
        pts = []
        expected = "points: send 1 to 100000 points, got 0"
    elif case == "empty_run":
        run = ""
        expected = "run: give a name of 1 to 200 characters"
    elif case == "live_run_name":
        run = "live"
        expected = "run: 'live' is the live run's name"
    else:
        raise AssertionError(case)
    return services_pb2.SubmitPointsRequest(run=run, points=pts), expected


BAD_CASES = [
    "nan_pass_rate",
    "inf_compute",
    "negative_compute",
    "pass_rate_above_one",
    "r0_outside",
    "zero_compute_after_r0",
    "repeated_version",
    "decreasing_compute",
    "no_r0",
    "no_points",
    "empty_run",
    "live_run_name",
]


async def test_bad_points_are_invalid_argument_naming_the_field_and_the_service_stays_up(fitter: Fitter) -> None:
    """The fits' input is known: ``points()`` on the paper's curve, spoiled one field at a time."""
    stub, channel, _ = fitter
    for case in BAD_CASES:
        request, expected = _bad(case)
        answer = await send_bad_request(channel, "gRPC Fitter", SUBMIT_POINTS, request.SerializeToString())
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, case
        assert answer.details.startswith(expected), (case, answer.details)
    # A refused request stores nothing.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetProjection(services_pb2.GetProjectionRequest(run="bad"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    # Valid points that cannot support a fit: a projection that says why.
    few = await stub.SubmitPoints(services_pb2.SubmitPointsRequest(run="few", points=points()[:3]))
    assert not few.ok and few.reason.startswith("too few points after the early cutoff")
    flat = points()
    for point in flat[1:]:
        point.pass_rate = 0.4
    refused = await stub.SubmitPoints(services_pb2.SubmitPointsRequest(run="flat", points=flat))
    assert not refused.ok and refused.reason == "all pass rates equal (0.4) after the cutoff: no curve to fit"
    assert await stub.GetProjection(services_pb2.GetProjectionRequest(run="flat")) == refused

    # Still serving: health says so and a good request is fitted.
    health = health_pb2_grpc.HealthStub(channel)
    status = await health.Check(health_pb2.HealthCheckRequest(service="asymptote.contracts.v1.Fitter"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    good = await stub.SubmitPoints(services_pb2.SubmitPointsRequest(run="after", points=points()))
    assert good.ok and good.a == pytest.approx(A, abs=1e-4)


BAD_VALUES = {
    "compute": [float("nan"), float("inf"), float("-inf"), -1.0, -5e-324],
    "pass_rate": [float("nan"), float("inf"), float("-inf"), -0.5, -5e-324, 1.0000001, 2.0, 1e308],
}


async def test_a_point_with_a_bad_value_is_refused_naming_it(fitter: Fitter) -> None:
    """The fit's input is known: ``points()``, with bad values drawn from a seeded generator."""
    stub, channel, _ = fitter
    rng = random.Random(12)
    for _ in range(60):
        pts = points(rng.randint(1, 30))
        i = rng.randrange(len(pts))
        field = rng.choice(sorted(BAD_VALUES))
        setattr(pts[i], field, rng.choice(BAD_VALUES[field]))
        request = services_pb2.SubmitPointsRequest(run=f"run-{rng.randrange(1000)}", points=pts)
        answer = await send_bad_request(channel, "gRPC Fitter", SUBMIT_POINTS, request.SerializeToString())
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, (i, field, answer.code, answer.details)
        assert answer.details.startswith(f"points[{i}].{field} is "), (i, field, answer.details)
    good = await stub.SubmitPoints(services_pb2.SubmitPointsRequest(run="after", points=points()))
    assert good.ok


# What INVALID_ARGUMENT and NOT_FOUND name: the run, the points, or one point's field.
NAMED_FIELD = re.compile(r"(run|points)(\[\d+\]\.(compute|pass_rate|policy_version))?[: ]")


async def test_malformed_requests_on_every_method_get_a_status_naming_the_problem(fitter: Fitter) -> None:
    """The fit's input is known: ``points()``, with corruptions drawn from a seeded generator."""
    stub, channel, _ = fitter
    rng = random.Random(11)
    valid = {
        SUBMIT_POINTS: services_pb2.SubmitPointsRequest(run="mutated", points=points(8)).SerializeToString(),
        GET_PROJECTION: services_pb2.GetProjectionRequest(run="mutated").SerializeToString(),
    }
    for method, good in valid.items():
        *answers, too_big = await send_bad_requests(channel, "gRPC Fitter", method, good, rng, 60, timeout_s=30)
        for answer in answers:
            what = (method, answer.request[:40], answer.code, answer.details)
            if answer.code == grpc.StatusCode.OK:
                continue  # the corruption left a valid request (e.g. another run name)
            if answer.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                assert NAMED_FIELD.match(answer.details), what
            else:
                assert answer.unparsable and "asymptote.contracts.v1." in answer.details, what
        assert too_big.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (method, too_big.code, too_big.details)
        assert "larger than max" in too_big.details

    # Still serving: a good request is fitted.
    good = await stub.SubmitPoints(services_pb2.SubmitPointsRequest(run="after", points=points()))
    assert good.ok and good.a == pytest.approx(A, abs=1e-4)
    assert await stub.GetProjection(services_pb2.GetProjectionRequest(run="after")) == good


async def test_live_run_projection_from_eval_results(fitter: Fitter, tmp_path: Path) -> None:
    """The fit's input is known: eval results on the paper's curve fed to the collector as the evals loop would."""
    stub, _, collector = fitter
    axis = collector.axis
    versions = list(range(0, 301, 20))
    expected_rates = {}
    for v in versions:
        # One generator held one device since t = 0; the learner two since t = 0.
        t = 10.0 * v + 1.0
        axis.observe(
            rollout_pb2.ComputeTelemetry(
                service="generator", instance_id="g", num_devices=1, device_seconds_total=t, unix_s=t, flops_total=t
            )
        )
        axis.observe(
            rollout_pb2.ComputeTelemetry(
                service="learner",
                instance_id="l",
                num_devices=2,
                device_seconds_total=2 * t,
                unix_s=t,
                flops_total=2 * t,
            )
        )
        axis.mark_version(v, t)
        rate = R0 if v == 0 else float(predict(3 * t, A, B, C_MID, R0))
        results = eval_round(v, rate)
        expected_rates[v] = sum(r.num_correct for r in results) / 400
        assert [collector.add_result(r) for r in results[:-1]] == [None] * 3
        point = collector.add_result(results[-1])
        assert point is not None and point.compute == pytest.approx(3 * t) and point.num_prompts == 4
        assert collector.add_result(results[0]) is None  # a redelivered result after the round closed
    live = await stub.GetProjection(services_pb2.GetProjectionRequest())
    assert live.ok, live.reason
    assert live.r0 == pytest.approx(expected_rates[0])
    # Pass rates are rounded to 1/400: the fit lands close to the curve they came from.
    assert live.a == pytest.approx(A, abs=0.03)
    assert live.c_mid == pytest.approx(C_MID, rel=0.15)
    assert live.a_interval.low <= live.a <= live.a_interval.high
    (projected,) = live.projections
    assert projected.compute == pytest.approx(2 * 3 * (10.0 * 300 + 1.0))
    assert projected.interval.low <= projected.pass_rate <= projected.interval.high
    rows = (tmp_path / "eval.jsonl").read_text().splitlines()
    assert len(rows) == len(versions)
    assert (tmp_path / "fit.json").exists()


async def test_an_eval_round_sits_at_the_compute_of_the_versions_that_sampled_it(
    fitter: Fitter, tmp_path: Path
) -> None:
    """Issued at version 10, sampled by versions 16 and 18 (in flight): placed at their compute, token-weighted."""
    _, _, collector = fitter
    axis = collector.axis
    for v in (0, 10, 16, 18):
        axis.observe(
            rollout_pb2.ComputeTelemetry(
                service="learner",
                instance_id="l",
                num_devices=1,
                device_seconds_total=5.0 * v,
                unix_s=5.0 * v,
                flops_total=5.0 * v,
            )
        )
        axis.mark_version(v, 5.0 * v)
    results = eval_round(10, 0.5, num_prompts=2)
    results[0].tokens_by_version.update({16: 30, 18: 10})
    results[1].tokens_by_version.update({18: 60})
    results[0].min_version, results[0].max_version = 16, 18
    results[1].min_version = results[1].max_version = 18
    assert collector.add_result(results[0]) is None
    point = collector.add_result(results[1])
    assert point is not None
    # 30 tokens at version 16 (80 s) and 70 at version 18 (90 s); version 10's own compute is 50 s.
    assert point.compute == pytest.approx((30 * 80.0 + 70 * 90.0) / 100)
    assert point.tokens_by_version == {"16": 30, "18": 70}
    assert point.compute_by_version == {"16": 80.0, "18": 90.0}
    assert point.sampled_version == pytest.approx(17.4)
    row = json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[-1])
    assert (row["policy_version"], row["min_version"], row["max_version"]) == (10, 16, 18)
    assert row["compute"] == pytest.approx(87.0)


async def test_an_eval_row_keeps_each_prompts_counts_in_prompt_order(fitter: Fitter, tmp_path: Path) -> None:
    """Results that arrive out of order land in eval.jsonl sorted by prompt id, each prompt's correct and
    sampled counts beside it, and a restarted fitter reads them back: what a paired bootstrap pairs on."""
    _, _, collector = fitter
    results = eval_round(0, 0.3, num_prompts=3)  # 90 correct of 300: 30 per prompt
    results[0].prompt_id, results[1].prompt_id, results[2].prompt_id = "q-b", "q-c", "q-a"
    results[0].num_correct, results[1].num_correct, results[2].num_correct = 7, 41, 42
    results[2].num_samples = 60
    for result in (results[1], results[2]):
        assert collector.add_result(result) is None
    point = collector.add_result(results[0])
    assert point is not None
    assert point.prompt_ids == ["q-a", "q-b", "q-c"]
    assert point.correct == [42, 7, 41]
    assert point.samples == [60, 100, 100]
    assert point.num_samples == 260
    row = json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[-1])
    assert (row["prompt_ids"], row["correct"], row["samples"]) == (["q-a", "q-b", "q-c"], [42, 7, 41], [60, 100, 100])
    (reloaded,) = load_points(tmp_path / "eval.jsonl")
    assert reloaded == point


def _scrape(registry: CollectorRegistry) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if "compute" not in sample.labels  # one value per name: leave out the projections
    }


def _run_points(num_points: int, a: float, b: float) -> list[Point]:
    compute = np.linspace(C_MID / 10, 2 * C_MID, num_points - 1)
    rates = [R0, *predict(compute, a, b, C_MID, R0)]
    return [
        Point(
            step=v,
            policy_version=v,
            compute=float(c),
            pass_rate=float(r),
            num_prompts=4,
            num_samples=400,
            min_version=v,
            max_version=v,
            unix_s=0.0,
        )
        for v, (c, r) in enumerate(zip([0.0, *compute], rates))
    ]


FIT_GAUGES = (
    "a",
    "a_low",
    "a_high",
    "b",
    "b_low",
    "b_high",
    "c_mid",
    "c_mid_low",
    "c_mid_high",
    "points_used",
    "rmse",
    "last_fit_unix_seconds",
)


def test_every_scrape_sees_one_fit_while_refits_run_concurrently(tmp_path: Path) -> None:
    """Scrapes run while refits do; after each refit the refitter waits for a scrape begun after it.

    The fits' input is known: ``_run_points`` on two given curves, in turn.

    So every published fit is seen by at least one scrape however the threads
    are scheduled (no count of scrapes depends on the machine's speed), and
    refits still run while a scrape reads.
    """
    collector = Collector(
        tmp_path, "live", CurveFitSettings(num_bootstrap_resamples=20), (2.0,), ComputeAxis(30.0), plot=False
    )
    registry = registry_with(ProjectionCollector("live", collector.snapshot, lambda: {"generator": 1.0}))
    datasets = [_run_points(20, 0.61, 1.9), _run_points(31, 0.75, 1.2)]
    published: list[tuple[float, ...]] = []
    scrapes: list[tuple[float, ...]] = []
    done = threading.Event()

    def scraped_to(count: int) -> Callable[[], bool]:
        return lambda: len(scrapes) >= count

    def refit_forever() -> None:
        for i in range(30):
            collector.points = datasets[i % 2]
            proj = collector.refit()
            assert proj.ok
            published.append(
                (
                    proj.a,
                    proj.a_interval.low,
                    proj.a_interval.high,
                    proj.b,
                    proj.b_interval.low,
                    proj.b_interval.high,
                    proj.c_mid,
                    proj.c_mid_interval.low,
                    proj.c_mid_interval.high,
                    proj.num_points_used,
                    proj.rmse,
                    proj.fitted_unix_s,
                    len(datasets[i % 2]),
                    datasets[i % 2][-1].compute,
                    datasets[i % 2][-1].pass_rate,
                )
            )
            # Two more scrapes: the second began after this fit was published.
            wait_until(scraped_to(len(scrapes) + 2), 60, f"two scrapes after refit {i}", interval_s=0.001)
        done.set()

    def scrape() -> tuple[float, ...]:
        """One scrape's fit; before the first refit, an empty tuple (nothing published yet)."""
        scraped = _scrape(registry)
        if "asymptote_fitter_a" not in scraped:
            return ()
        return (
            *tuple(scraped[f"asymptote_fitter_{name}"] for name in FIT_GAUGES),
            scraped["asymptote_fitter_points"],
            scraped["asymptote_fitter_last_compute"],
            scraped["asymptote_fitter_last_pass_rate"],
        )

    worker = threading.Thread(target=refit_forever)
    worker.start()
    try:
        while not done.is_set() and worker.is_alive():
            scrapes.append(scrape())
            time.sleep(0.001)  # pacing: as a scraper would, leave the refitting thread the interpreter
    finally:
        done.set()
        worker.join()
    assert len(published) == 30
    fits = [s for s in scrapes if s]
    assert len(fits) >= 30
    # Every scrape equals one published fit, points and latest point included (the
    # exposition prints floats with repr, so the values round-trip exactly).
    assert set(fits) <= set(published)
    assert set(fits) == set(published)  # every fit was seen
    assert {s[12] for s in fits} == {20.0, 31.0}  # both datasets' fits


def test_a_refused_refit_keeps_the_last_successful_fit_on_the_gauges(tmp_path: Path) -> None:
    """The fits' input is known: ``_run_points`` on a given curve, then too few of them."""
    collector = Collector(
        tmp_path, "live", CurveFitSettings(num_bootstrap_resamples=20), (2.0,), ComputeAxis(30.0), plot=False
    )
    registry = registry_with(ProjectionCollector("live", collector.snapshot, dict))
    before = _scrape(registry)
    assert before["asymptote_fitter_fit_ok"] == 0 and "asymptote_fitter_a" not in before
    collector.points = _run_points(20, 0.61, 1.9)
    good = collector.refit()
    collector.points = _run_points(20, 0.61, 1.9)[:4]  # R0 and three points: too few
    refused = collector.refit()
    assert good.ok and not refused.ok and "too few points" in refused.reason
    scraped = _scrape(registry)
    assert scraped["asymptote_fitter_fit_ok"] == 0
    assert scraped["asymptote_fitter_points"] == 4
    assert scraped["asymptote_fitter_a"] == good.a
    assert scraped["asymptote_fitter_points_used"] == good.num_points_used
    assert scraped["asymptote_fitter_last_fit_unix_seconds"] == good.fitted_unix_s
    assert collector.projection is refused and collector.snapshot().last_ok is good


def test_a_restarted_collector_refits_from_eval_jsonl_and_skips_a_cut_line(tmp_path: Path) -> None:
    """The fit's input is known: ``_run_points`` on a given curve, written where the fitter reads (eval.jsonl)."""
    run = _run_points(20, 0.61, 1.9)
    lines = [json.dumps(asdict(point)) for point in reversed(run)]  # any order: taken by version
    (tmp_path / "eval.jsonl").write_text("\n".join(lines) + '\n{"step": 40, "policy_ver')
    collector = Collector(
        tmp_path, "live", CurveFitSettings(num_bootstrap_resamples=20), (2.0,), ComputeAxis(30.0), plot=False
    )
    assert [p.policy_version for p in collector.points] == list(range(20))
    snap = collector.snapshot()
    assert snap.num_points == 20 and snap.projection.ok and snap.last_ok is snap.projection
    assert snap.projection.a == pytest.approx(0.61, abs=1e-4)
    assert snap.last_compute == run[-1].compute
    assert collector.is_done(19) and not collector.is_done(40)
    assert json.loads((tmp_path / "fit.json").read_text())["a"] == snap.projection.a


def _labelled(registry: CollectorRegistry, name: str, label: str) -> dict[str, float]:
    return {
        sample.labels[label]: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if sample.name == name
    }


def test_a_fit_at_its_bound_is_flagged_in_fit_json_and_on_the_gauges(tmp_path: Path) -> None:
    """A run heading to A = 0.9 fitted over the paper's A range (up to 0.8) ends on A's bound."""
    paper_range = CurveFitSettings(a_min=0.45, a_max=0.8, num_bootstrap_resamples=20)
    collector = Collector(tmp_path, "live", paper_range, (2.0,), ComputeAxis(30.0), plot=False)
    registry = registry_with(ProjectionCollector("live", collector.snapshot, dict))
    collector.points = _run_points(20, 0.9, 1.9)
    flagged = collector.refit()
    assert flagged.ok and flagged.a == pytest.approx(0.8)
    fit_json = json.loads((tmp_path / "fit.json").read_text())
    assert fit_json["at_bound"] == ["A"] and fit_json["identifiable"] is False
    assert fit_json["recommendation"] == "continue"
    assert fit_json["recommendation_reason"] == "not yet determined: A at the bound of the search range: run longer"
    assert fit_json["determined"] is False
    assert fit_json["why_not_determined"] == "A at the bound of the search range: run longer"
    assert _scrape(registry)["asymptote_fitter_identifiable"] == 0
    assert _labelled(registry, "asymptote_fitter_at_bound", "param") == {"A": 1.0, "B": 0.0, "C_mid": 0.0}
    assert _scrape(registry)["asymptote_fitter_determined"] == 0
    assert _labelled(registry, "asymptote_fitter_not_determined", "reason") == {
        "few_points": 0.0,
        "at_bound": 1.0,
        "a_at_cap": 0.0,
        "a_at_floor": 0.0,
        "c_mid_spread": 0.0,
    }
    assert _labelled(registry, "asymptote_fitter_recommendation", "action") == {
        "continue": 1.0,
        "stop": 0.0,
        "compare": 0.0,
    }

    # The same collector on a run the range holds: identifiable, nothing at a bound.
    collector.points = _run_points(20, 0.61, 1.9)
    good = collector.refit()
    assert good.identifiable and list(good.at_bound) == []
    fit_json = json.loads((tmp_path / "fit.json").read_text())
    assert fit_json["at_bound"] == [] and fit_json["identifiable"] is True
    assert _scrape(registry)["asymptote_fitter_identifiable"] == 1
    assert set(_labelled(registry, "asymptote_fitter_at_bound", "param").values()) == {0.0}
    # Noiseless points: the bootstrap collapses onto the fit, well inside A's range; 19 points fitted.
    assert fit_json["determined"] is True and fit_json["why_not_determined"] == "" and fit_json["not_determined"] == []
    assert _scrape(registry)["asymptote_fitter_determined"] == 1
    assert set(_labelled(registry, "asymptote_fitter_not_determined", "reason").values()) == {0.0}


def test_a_planned_budget_is_projected_and_recommended_against(tmp_path: Path) -> None:
    """The curve's points reach 2 C_mid; the budget 8 C_mid leaves 0.078 to gain: continue."""
    budget = 8 * C_MID
    collector = Collector(tmp_path, "live", SETTINGS, (2.0,), ComputeAxis(30.0), plot=False, planned_compute=budget)
    collector.points = _run_points(20, A, B)
    projection = collector.refit()
    assert projection.planned_compute == budget
    assert [p.compute for p in projection.projections] == pytest.approx([4 * C_MID, budget])
    gain = float(predict(budget, A, B, C_MID, R0) - predict(2 * C_MID, A, B, C_MID, R0))
    assert gain == pytest.approx(0.078, abs=0.001)
    assert projection.recommendation == "continue"
    # Noiseless points: the bootstrap collapses onto the fit, so the gain's upper end is the gain.
    assert projection.recommendation_reason == f"up to {gain:.3f} left to gain by the budget {budget:.4g}"
    # The dashboard finds the budget's projection by its target label.
    registry = registry_with(ProjectionCollector("live", collector.snapshot, dict))
    targets = {
        (sample.labels["target"], sample.labels["bound"]): (float(sample.labels["compute"]), sample.value)
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if sample.name == "asymptote_fitter_projected_pass_rate"
    }
    at_budget = projection.projections[1]
    assert targets[("budget", "mid")] == (pytest.approx(budget), at_budget.pass_rate)
    assert targets[("budget", "high")] == (pytest.approx(budget), at_budget.interval.high)
    assert targets[("multiple", "mid")] == (pytest.approx(4 * C_MID), projection.projections[0].pass_rate)


def test_the_half_run_check_is_exported_and_matches_the_offline_check(tmp_path: Path) -> None:
    """The live gauges carry ``holdout.project_from_half`` on the same points; on a clean curve it is exact."""
    collector = Collector(
        tmp_path, "live", CurveFitSettings(num_bootstrap_resamples=20), (2.0,), ComputeAxis(30.0), plot=False
    )
    registry = registry_with(ProjectionCollector("live", collector.snapshot, dict))
    collector.points = _run_points(20, 0.61, 1.9)[:2]  # R0 and one point: no first half to fit
    collector.refit()
    assert "asymptote_fitter_half_run_projected_pass_rate" not in _scrape(registry)
    run = _run_points(20, 0.61, 1.9)
    collector.points = run
    collector.refit()
    scraped = _scrape(registry)
    curve = run[1:]
    expected = project_from_half([p.compute for p in curve], [p.pass_rate for p in curve], R0, collector.settings)
    assert scraped["asymptote_fitter_half_run_measured_pass_rate"] == run[-1].pass_rate
    assert scraped["asymptote_fitter_half_run_projected_pass_rate"] == expected["projected"]
    # Points on the curve itself: the first half projects the end to within the fit's tolerance.
    assert expected["projected"] == pytest.approx(run[-1].pass_rate, abs=1e-3)
