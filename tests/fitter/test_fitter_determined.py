"""A live projection a user can trust: when a fit is determined, and how consecutive live fits behave.

The rule (``decision.determination``) on fits of known data, each way a fit
can fall short of it, and the case that was reported: an interval for A
that reaches the cap 1.0 gives "not yet determined" and no gain read off
it. Then recorded eval streams replayed through the live fitter's own path
(``Collector.add_result``, as the evals loop feeds it) with ``fit.json``
read after every round, as the progress line reads it.

Synthetic streams first: the sigmoid's pass rate, measured as a held-out round measures it (200
prompts x 4 samples, each prompt's correct count binomial), every 10
versions up to 300, seeded. Rising runs, one that stays flat, one still
early and one whose A stays open (the reported run's shape). Then the
eval.jsonl of ten real runs of the embedded default (tests/fitter/streams/:
three of 120 steps, seven of the default 300), replayed round by round the
same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from asymptote.compute import compute_text
from asymptote.contracts.v1 import rollout_pb2
from services.fitter.collector import Collector
from services.fitter.compute_axis import ComputeAxis
from services.fitter.curve import (
    CurveFit,
    CurveFitSettings,
    Interval,
    Intervals,
    bootstrap_intervals,
    fit_curve,
    predict,
)
from services.fitter.decision import (
    A_BOUND_TOLERANCE,
    MARGIN,
    MAX_C_MID_SPREAD,
    MIN_POINTS_DETERMINED,
    Recommendation,
    determination,
    recommend,
)
from services.fitter.offline import fit_run, load_run
from services.local.progress import a_text
from tests.helpers.fitcheck import check_fit, point_estimates

NUM_PROMPTS, NUM_SAMPLES = 200, 4
EVERY_VERSIONS = 10
COMPUTE_PER_VERSION_S = 60.0
"""Accelerator-seconds per policy version (one device, one version a minute)."""
SETTINGS = CurveFitSettings()
"""The live fitter's defaults (FitterConfig.curve): A searched up to 1.0, 200 bootstrap resamples."""
TARGET_MULTIPLES = (2.0, 10.0)
"""The live fitter's default projections (FitterConfig.target_compute_multiples)."""


@dataclass(frozen=True)
class Stream:
    """A run's eval rounds on a known sigmoid, measured with a held-out round's noise."""

    name: str
    a: float
    b: float
    c_mid_version: float
    """The version at which half the gain A - R0 is reached."""
    r0: float
    last_version: int
    seed: int

    def rounds(self) -> list[tuple[int, npt.NDArray[np.int64]]]:
        """Each round's version and the number correct of each prompt's samples."""
        rng = np.random.default_rng(self.seed)
        rounds = []
        for version in range(0, self.last_version + 1, EVERY_VERSIONS):
            compute = version * COMPUTE_PER_VERSION_S
            rate = self.r0
            if version > 0:
                rate = float(predict(compute, self.a, self.b, self.c_mid_version * COMPUTE_PER_VERSION_S, self.r0))
            rounds.append((version, rng.binomial(NUM_SAMPLES, rate, size=NUM_PROMPTS)))
        return rounds

    def points(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], float]:
        """(compute, pass rate) of the rounds after R0, and R0: what the fitter fits."""
        (_, baseline), *rest = self.rounds()
        compute = np.array([version * COMPUTE_PER_VERSION_S for version, _ in rest])
        pass_rate = np.array([correct.sum() / (NUM_PROMPTS * NUM_SAMPLES) for _, correct in rest])
        return compute, pass_rate, float(baseline.sum() / (NUM_PROMPTS * NUM_SAMPLES))


# The reported run's shape: a slow rise, half its gain at version 250, whose A the points leave open above.
OPEN = Stream("open", a=0.70, b=1.2, c_mid_version=250, r0=0.30, last_version=300, seed=1)


def _fitted(compute: npt.ArrayLike, pass_rate: npt.ArrayLike, r0: float) -> tuple[CurveFit, Intervals]:
    fit = fit_curve(compute, pass_rate, r0, SETTINGS)
    return fit, bootstrap_intervals(compute, pass_rate, r0, SETTINGS, fit)


def test_the_reported_case_an_interval_reaching_the_cap_is_not_determined_and_gives_no_gain() -> None:
    """A 0.56 [0.40, 1.00], nothing at a bound: the advice read "up to 0.579 left to gain" off the cap.

    Here a run of that shape: A 0.597 [0.515, 1.000] at version 300, identifiable."""
    compute, pass_rate, r0 = OPEN.points()
    fit, intervals = _fitted(compute, pass_rate, r0)
    assert fit.identifiable and fit.num_points_used == 30
    assert intervals.a.high == pytest.approx(1.0, abs=A_BOUND_TOLERANCE)
    assert intervals.c_mid.high / intervals.c_mid.low <= MAX_C_MID_SPREAD  # only A's interval falls short
    judged = determination(fit, intervals)
    assert [shortfall.kind for shortfall in judged.shortfalls] == ["a_at_cap"]
    assert judged.why_not == (
        f"A's interval [{intervals.a.low:.3f}, {intervals.a.high:.3f}] reaches the cap 1.000: "
        "run longer, until the curve bends"
    )
    now = float(compute[-1])
    # What the advice used to read off the cap: far more than the margin.
    assert intervals.a.high - float(fit.predict(now)) > 10 * MARGIN
    for budget in (None, 2 * now):
        advice = recommend(fit, intervals, now, budget)
        assert advice.action == "continue" and advice.gain_left is None
        assert advice.reason == f"not yet determined: {judged.why_not}"

    # The reported numbers themselves on that fit: both intervals fall short, and each says what would help.
    reported = replace(intervals, a=Interval(0.402, 1.000), c_mid=Interval(201.0, 173_442.0))
    advice = recommend(fit, reported, now)
    assert advice.gain_left is None
    assert advice.reason == (
        "not yet determined: A's interval [0.402, 1.000] reaches the cap 1.000: run longer, until the curve bends; "
        "C_mid's interval [201, 1.734e+05] spans 863x (at most 10x): more points past the midpoint"
    )


def _noiseless(num_points: int) -> tuple[CurveFit, Intervals]:
    """The paper's 8B curve (A 0.610, B 1.92, C_mid 2542) from 0.2 to 3 C_mid: the bootstrap collapses onto it."""
    compute = np.linspace(500.0, 7600.0, num_points)
    return _fitted(compute, predict(compute, 0.61, 1.92, 2542.0, 0.2), 0.2)


def test_a_fit_pinned_down_by_its_points_is_determined_and_advised_off_its_interval() -> None:
    fit, intervals = _noiseless(12)
    judged = determination(fit, intervals)
    assert judged.determined and judged.why_not == "" and judged.shortfalls == ()
    assert fit.a_bounds.low == pytest.approx(0.2) and fit.a_bounds.high == 1.0
    advice = recommend(fit, intervals, 7600.0, 16_000.0)
    expected = float(predict(16_000.0, 0.61, 1.92, 2542.0, 0.2) - predict(7600.0, 0.61, 1.92, 2542.0, 0.2))
    assert advice.action == "continue" and advice.gain_left == pytest.approx(expected, abs=1e-4)


def test_too_few_points_are_not_determined_however_well_they_fit() -> None:
    fit, intervals = _noiseless(MIN_POINTS_DETERMINED - 1)
    judged = determination(fit, intervals)
    assert (
        judged.why_not == f"{MIN_POINTS_DETERMINED - 1} points used, at least {MIN_POINTS_DETERMINED}: more eval rounds"
    )
    assert determination(*_noiseless(MIN_POINTS_DETERMINED)).determined


@pytest.mark.parametrize(
    ("a", "c_mid", "kinds", "why"),
    [
        # Within A_BOUND_TOLERANCE of the cap 1.0 reaches it; just below does not.
        ((0.55, 0.996), None, ["a_at_cap"], "A's interval [0.550, 0.996] reaches the cap 1.000: run longer"),
        ((0.55, 0.994), None, [], ""),
        # R0 is 0.2: an interval down to 0.204 leaves "no gain" open.
        ((0.204, 0.70), None, ["a_at_floor"], "A's interval [0.204, 0.700] reaches R0 0.200: run longer"),
        ((0.206, 0.70), None, [], ""),
        # C_mid's interval: at most 10x wide.
        (None, (300.0, 3000.0), [], ""),
        (None, (300.0, 3300.0), ["c_mid_spread"], "C_mid's interval [300, 3300] spans 11.0x (at most 10x): more"),
        # Just over the limit reads as over it, never as "10x (at most 10x)".
        (None, (460.3, 4654.0), ["c_mid_spread"], "C_mid's interval [460.3, 4654] spans 10.1x (at most 10x)"),
        ((0.30, 1.0), (10.0, 8600.0), ["a_at_cap", "c_mid_spread"], "A's interval [0.300, 1.000] reaches the cap"),
    ],
)
def test_each_way_an_interval_falls_short_is_named_and_gives_no_gain(
    a: tuple[float, float] | None, c_mid: tuple[float, float] | None, kinds: list[str], why: str
) -> None:
    fit, intervals = _noiseless(12)
    changed = replace(
        intervals,
        a=Interval(*a) if a else intervals.a,
        c_mid=Interval(*c_mid) if c_mid else intervals.c_mid,
    )
    judged = determination(fit, changed)
    assert [shortfall.kind for shortfall in judged.shortfalls] == kinds
    assert judged.why_not.startswith(why)
    advice = recommend(fit, changed, 7600.0, 16_000.0)
    if kinds:
        assert advice == Recommendation("continue", f"not yet determined: {judged.why_not}", None)
    else:
        assert advice.gain_left is not None and advice.gain_left > 0


def test_a_floor_set_by_a_min_is_named_as_such_and_a_fixed_a_has_no_interval_to_judge() -> None:
    compute = np.linspace(500.0, 7600.0, 12)
    pass_rate = predict(compute, 0.61, 1.92, 2542.0, 0.2)
    settings = SETTINGS.model_copy(update={"a_min": 0.45})
    fit = fit_curve(compute, pass_rate, 0.2, settings)
    intervals = bootstrap_intervals(compute, pass_rate, 0.2, settings, fit)
    assert fit.a_bounds == Interval(0.45, 1.0)
    low = replace(intervals, a=Interval(0.452, 0.7))
    assert determination(fit, low).why_not.startswith("A's interval [0.452, 0.700] reaches its floor a_min 0.450")
    fixed = fit_curve(compute, pass_rate, 0.2, SETTINGS, fixed_a=0.61)
    fixed_intervals = bootstrap_intervals(compute, pass_rate, 0.2, SETTINGS, fixed)
    assert fixed_intervals.a == (0.61, 0.61) and fixed.a_bounds == (0.61, 0.61)
    assert determination(fixed, fixed_intervals).determined


# Replayed streams: (stream, final fit determined?, the final fit's reasons if not).
STREAMS = [
    (Stream("rising", a=0.55, b=2.0, c_mid_version=60, r0=0.25, last_version=300, seed=1), True, []),
    (Stream("rising-steep", a=0.60, b=2.5, c_mid_version=80, r0=0.30, last_version=300, seed=2), True, []),
    (OPEN, False, ["a_at_cap"]),
    (
        Stream("flat", a=0.30, b=1.5, c_mid_version=100, r0=0.30, last_version=300, seed=14),
        False,
        ["at_bound", "a_at_floor", "c_mid_spread"],
    ),
    (Stream("early", a=0.60, b=1.5, c_mid_version=100, r0=0.30, last_version=90, seed=4), False, ["at_bound"]),
]
BUDGET_S = 600 * COMPUTE_PER_VERSION_S
"""The planned budget: twice the runs' 300 versions."""


def replay(stream: Stream, run_dir: Path) -> list[dict[str, Any]]:
    """Feed the stream's rounds to a live collector as the evals loop does; fit.json after each round,
    checked against eval.jsonl (``fitcheck.check_fit``)."""
    axis = ComputeAxis(stale_s=30.0)
    collector = Collector(run_dir, stream.name, SETTINGS, TARGET_MULTIPLES, axis, plot=False, planned_compute=BUDGET_S)
    fits = []
    for version, correct in stream.rounds():
        # One device since t = 0, its tokens one FLOP a second: both axes read one unit per second.
        now = version * COMPUTE_PER_VERSION_S
        axis.observe(
            rollout_pb2.ComputeTelemetry(
                service="generator",
                instance_id="g",
                num_devices=1,
                device_seconds_total=now,
                unix_s=now,
                flops_total=now,
            )
        )
        axis.mark_version(version, now)
        results = [
            rollout_pb2.EvalResult(
                eval_id=f"eval-{version}",
                task_id=f"eval-{version}-{prompt}",
                prompt_id=f"p{prompt}",
                num_samples=NUM_SAMPLES,
                num_correct=int(n),
                eval_version=version,
                min_version=version,
                max_version=version,
                eval_num_prompts=NUM_PROMPTS,
                finished_unix_s=now,
                tokens_by_version={version: 100},
            )
            for prompt, n in enumerate(correct)
        ]
        points = [collector.add_result(result) for result in results]
        assert points[:-1] == [None] * (NUM_PROMPTS - 1) and points[-1] is not None
        assert points[-1].compute == now
        fit = json.loads((run_dir / "fit.json").read_text())
        # fit.json is the fitter's fit of eval.jsonl: its RMSE, projections and determination agree.
        check_fit(fit, [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()])
        fits.append(fit)
    return fits


def shows_interval(fit: dict[str, Any]) -> bool:
    """Whether the progress line shows A's interval for this fit.json (``progress.a_text``)."""
    return bool(fit["ok"]) and "few_points" not in fit["not_determined"]


def overlap(first: dict[str, Any], second: dict[str, Any]) -> bool:
    a, b = first["a_interval"], second["a_interval"]
    return bool(a["low"] <= b["high"] and b["low"] <= a["high"])


@pytest.mark.parametrize(("stream", "final_determined", "final_kinds"), STREAMS, ids=[s[0].name for s in STREAMS])
def test_replayed_streams_keep_the_stability_rule_and_end_determined_or_say_why(
    stream: Stream, final_determined: bool, final_kinds: list[str], tmp_path: Path
) -> None:
    fits = replay(stream, tmp_path)
    assert len(fits) == stream.last_version // EVERY_VERSIONS + 1
    for fit in fits:
        # Every fit is determined or says why not; the advice is never read off an undetermined fit.
        assert isinstance(fit["determined"], bool)
        if fit["determined"]:
            assert fit["ok"] and fit["why_not_determined"] == "" and fit["not_determined"] == []
            assert not fit["recommendation_reason"].startswith("not yet determined")
        else:
            assert fit["why_not_determined"]
            if fit["ok"]:
                assert fit["recommendation"] == "continue"
                assert fit["recommendation_reason"] == f"not yet determined: {fit['why_not_determined']}"
        # The progress line: A with its interval, never a bare point estimate.
        line = a_text(fit)
        if not fit["ok"]:
            assert line is None
            continue
        assert line is not None
        interval = f"[{fit['a_interval']['low']:.3f}, {fit['a_interval']['high']:.3f}]"
        if fit["determined"]:
            (at_budget,) = [p for p in fit["projections"] if p["compute"] == BUDGET_S]
            budget = (
                f"at budget {compute_text(BUDGET_S, 'flops')}: "
                f"{at_budget['pass_rate']:.3f} [{at_budget['interval']['low']:.3f}, "
            )
            assert line.startswith(f"A {fit['a']:.3f} {interval}") and budget in line
        elif shows_interval(fit):
            assert line == f"A in {interval}, not yet determined: {fit['why_not_determined']}"
        else:
            assert line == f"A not yet determined: {fit['why_not_determined']}"

    # The stability rule: consecutive A intervals the progress line shows overlap.
    shown = [(first, second) for first, second in pairwise(fits) if shows_interval(first) and shows_interval(second)]
    assert shown, "no two consecutive fits showed A's interval"
    apart = [(first["num_points"], second["num_points"]) for first, second in shown if not overlap(first, second)]
    assert apart == []

    final = fits[-1]
    assert final["determined"] is final_determined
    if final_determined:
        # The true asymptote lies in (a 95% interval misses one run in twenty: rising-steep's by 0.0003), or
        # within the paper's run-to-run margin of, what the line shows.
        low, high = final["a_interval"]["low"], final["a_interval"]["high"]
        assert low - MARGIN <= stream.a <= high + MARGIN
    else:
        assert final["not_determined"] == final_kinds
    # The live fit is the fitter's own fit of its eval.jsonl: ``asymptote fit`` reads the same.
    offline = fit_run(load_run(tmp_path, stream.name), SETTINGS, (), half_run=False, planned_compute=BUDGET_S)
    if not final["ok"]:
        assert offline.fit is None and offline.error == final["reason"]
        return
    assert offline.fit is not None and offline.intervals is not None and offline.determination is not None
    assert offline.fit.a == pytest.approx(point_estimates(final)["a"], rel=1e-12)
    assert offline.intervals.a.low == pytest.approx(final["a_interval"]["low"], rel=1e-12)
    assert offline.intervals.a.high == pytest.approx(final["a_interval"]["high"], rel=1e-12)
    assert offline.determination.determined is final["determined"]
    assert offline.determination.why_not == final["why_not_determined"]


# Recorded streams: the eval.jsonl of real runs of the embedded default (`asymptote up`, the word problems,
# each with its seed), kept in tests/fitter/streams/ and replayed row by row through the live fitter's path.
RECORDED = sorted((Path(__file__).parent / "streams").glob("*.jsonl"))
RECORDED_RUNS = 10


def replay_recorded(path: Path, run_dir: Path) -> list[dict[str, Any]]:
    """fit.json after each round of a recorded run, as the live fitter writes it (``Collector.refit`` over
    the rows so far, planned to twice the run's compute)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    budget = 2 * max(row["compute"] for row in rows)
    fits = []
    for i in range(1, len(rows) + 1):
        run_dir.mkdir(exist_ok=True)
        (run_dir / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:i]))
        collector = Collector(
            run_dir, path.stem, SETTINGS, TARGET_MULTIPLES, ComputeAxis(30.0), plot=False, planned_compute=budget
        )
        collector.refit()
        fits.append(json.loads((run_dir / "fit.json").read_text()))
    return fits


def test_the_recorded_runs_are_there() -> None:
    assert len(RECORDED) == RECORDED_RUNS, RECORDED


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_recorded_runs_keep_the_stability_rule_and_end_determined_or_say_why(path: Path, tmp_path: Path) -> None:
    fits = replay_recorded(path, tmp_path / "run")
    for fit in fits:
        assert isinstance(fit["determined"], bool)
        assert fit["determined"] or fit["why_not_determined"]
        if fit["ok"] and not fit["determined"]:
            assert fit["recommendation_reason"] == f"not yet determined: {fit['why_not_determined']}"
    shown = [(first, second) for first, second in pairwise(fits) if shows_interval(first) and shows_interval(second)]
    apart = [(first["num_points"], second["num_points"]) for first, second in shown if not overlap(first, second)]
    assert apart == []
    statements = [
        f"{f['num_points']}: " + (a_text(f) or f"no fit: {f.get('reason') or f['why_not_determined']}") for f in fits
    ]
    print("\n".join(statements))
    final = fits[-1]
    assert final["determined"] or (final["why_not_determined"] and final["not_determined"])
