"""What a fit lets one decide: recommendations and the recipe comparison.

The recommendation's three answers (continue, stop, compare) and its
refusal to project a fit at its bound, with numbers; the comparison ranks
only identifiable fits, answers "undecided: run longer" when intervals
overlap or a fit is at its bound (with how much longer where the fits
allow), and decides when the intervals separate.
"""

from __future__ import annotations

import numpy as np
import pytest

from services.fitter.curve import (
    CurveFit,
    CurveFitSettings,
    FitError,
    Intervals,
    bootstrap_intervals,
    fit_curve,
    predict,
)
from services.fitter.decision import compare_runs, extended_run, recommend, summary_line

PAPER_DENSE = {"a": 0.610, "b": 1.92, "c_mid": 2542.0, "r0": 0.20}
# The paper's A range (0.450..0.800): a run heading above 0.8 ends on its upper bound.
PAPER_A_RANGE = CurveFitSettings(a_min=0.45, a_max=0.8)


def _curve(compute: np.ndarray, params: dict[str, float]) -> np.ndarray:
    return predict(compute, params["a"], params["b"], params["c_mid"], params["r0"])


def _noisy(compute: np.ndarray, a: float, sd: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(predict(compute, a, 1.9, 2542.0, 0.2) + rng.normal(0.0, sd, compute.size), 0.0, 1.0)


def _fitted(
    compute: np.ndarray, pass_rate: np.ndarray, settings: CurveFitSettings | None = None
) -> tuple[CurveFit, Intervals]:
    fit = fit_curve(compute, pass_rate, 0.2, settings)
    return fit, bootstrap_intervals(compute, pass_rate, 0.2, settings, fit)


def test_recommend_continue_while_the_budget_holds_more_than_the_margin() -> None:
    compute = np.linspace(200.0, 4000.0, 40)
    fit, intervals = _fitted(compute, _curve(compute, PAPER_DENSE))
    # Noiseless: the fit is the truth, so the gain left is the curve's own.
    now, then = float(predict(4000.0, 0.61, 1.92, 2542.0, 0.2)), float(predict(16_000.0, 0.61, 1.92, 2542.0, 0.2))
    assert then - now == pytest.approx(0.109, abs=0.001)
    advice = recommend(fit, intervals, 4000.0, 16_000.0)
    assert advice.action == "continue"
    assert advice.gain_left == pytest.approx(then - now, abs=1e-4)
    assert "budget 1.6e+04" in advice.reason


def test_recommend_stop_when_the_gain_left_is_within_the_margin() -> None:
    compute = np.linspace(200.0, 16_000.0, 80)
    fit, intervals = _fitted(compute, _curve(compute, PAPER_DENSE))
    # At 16k the curve is within 0.007 of A: doubling the budget gains less than 0.02.
    advice = recommend(fit, intervals, 16_000.0, 32_000.0)
    assert advice.action == "stop"
    assert advice.gain_left is not None and 0.0 < advice.gain_left <= 0.02
    expected = float(predict(32_000.0, 0.61, 1.92, 2542.0, 0.2) - predict(16_000.0, 0.61, 1.92, 2542.0, 0.2))
    assert advice.gain_left == pytest.approx(expected, abs=1e-4)
    # Without a budget it looks to the asymptote: 0.61 - 0.603 is within the margin too.
    assert recommend(fit, intervals, 16_000.0).action == "stop"
    assert recommend(fit, intervals, 16_000.0, 8000.0).reason == "the planned budget 8000 is spent"


def test_recommend_compare_when_a_rival_asymptote_is_within_the_margin() -> None:
    compute = np.linspace(200.0, 4000.0, 40)
    fit, intervals = _fitted(compute, _curve(compute, PAPER_DENSE))
    advice = recommend(fit, intervals, 4000.0, 16_000.0, rival_asymptotes={"dapo": 0.625, "gspo": 0.55})
    assert advice.action == "compare"
    assert "within 0.02 of dapo" in advice.reason and "gspo" not in advice.reason
    assert recommend(fit, intervals, 4000.0, 16_000.0, rival_asymptotes={"gspo": 0.55}).action == "continue"


def test_recommend_does_not_project_a_fit_at_its_bound() -> None:
    compute = np.linspace(500.0, 20_000.0, 40)
    pass_rate = predict(compute, 0.9, 1.9, 2542.0, 0.2)
    fit = fit_curve(compute, pass_rate, 0.2, PAPER_A_RANGE)
    intervals = bootstrap_intervals(compute, pass_rate, 0.2, PAPER_A_RANGE, fit)
    assert fit.params_at_bounds == ("A",) and not fit.identifiable
    advice = recommend(fit, intervals, 20_000.0, 40_000.0)
    assert advice.action == "continue" and advice.gain_left is None
    assert advice.reason == "not yet determined: A at the bound of the search range: run longer"
    with pytest.raises(ValueError, match="planned_compute must be a finite compute > 0"):
        recommend(fit, intervals, 20_000.0, -1.0)


def test_comparison_is_undecided_when_a_run_is_at_its_bound() -> None:
    """The case of a run at A's bound ranked above an identifiable one: now neither is ordered."""
    compute = np.linspace(500.0, 20_000.0, 40)
    runs = {
        "at-bound": (compute, predict(compute, 0.9, 1.9, 2542.0, 0.2), 0.2),
        "steady": (compute, _noisy(compute, 0.67, 0.005, 1), 0.2),
    }
    rows = compare_runs(runs, PAPER_A_RANGE)
    by_name = {row.name: row for row in rows}
    assert by_name["at-bound"].a == pytest.approx(0.8) and not by_name["at-bound"].identifiable
    assert by_name["at-bound"].rank is None and by_name["at-bound"].decided_by == "undecided"
    assert by_name["at-bound"].verdict.startswith("undecided: run longer (not yet identifiable: A at the bound")
    assert by_name["steady"].rank == 1 and by_name["steady"].identifiable
    assert rows[-1].name == "at-bound"  # unranked runs come last, whatever their A
    assert summary_line(rows).startswith("undecided: run longer (at-bound not ordered")


def test_comparison_is_undecided_when_intervals_overlap_and_says_how_much_longer() -> None:
    # Short, noisy runs 0.05 apart in A: the fits differ by more than the margin, the intervals overlap.
    compute = np.linspace(200.0, 4000.0, 20)
    runs = {"hi": (compute, _noisy(compute, 0.66, 0.01, 2), 0.2), "lo": (compute, _noisy(compute, 0.61, 0.01, 3), 0.2)}
    rows = compare_runs(runs)
    hi, lo = rows
    assert (hi.name, lo.name) == ("hi", "lo")
    assert hi.a - lo.a > 0.02 and lo.a_interval.high >= hi.a_interval.low
    assert hi.decided_by == "asymptote" and lo.decided_by == "undecided"
    assert hi.rank == lo.rank == 1
    # Continued as the fits expect, with the runs' own residuals, the A intervals part at 2x the compute.
    assert lo.compute_multiple_to_decide == 2.0
    assert lo.verdict == (
        "undecided: run longer (A intervals overlap with hi; about 2x the compute would decide against hi)"
    )
    assert summary_line(rows) == "undecided: run longer (lo not ordered; about 2x the compute would decide)"
    # The runs continued to 2x as the estimate continues them are decided; to 1.5x they are not.
    for multiple, expected in ((2.0, "asymptote"), (1.5, "undecided")):
        longer = {}
        for name, (c, y, r0) in runs.items():
            longer[name] = (*extended_run(c, y, fit_curve(c, y, r0), multiple), r0)
        assert compare_runs(longer, estimate=False)[1].decided_by == expected


def test_comparison_decides_when_intervals_separate() -> None:
    compute = np.linspace(200.0, 16_000.0, 80)
    runs = {
        "lo": (compute, _noisy(compute, 0.61, 0.005, 3), 0.2),
        "hi": (compute, _noisy(compute, 0.66, 0.005, 2), 0.2),
    }
    rows = compare_runs(runs)
    assert [(row.name, row.rank, row.decided_by) for row in rows] == [("hi", 1, "asymptote"), ("lo", 2, "asymptote")]
    assert rows[1].a_interval.high < rows[0].a_interval.low
    assert rows[0].a == pytest.approx(0.66, abs=0.01) and rows[1].a == pytest.approx(0.61, abs=0.01)
    assert summary_line(rows) == "decided: hi > lo"
    assert all(row.compute_multiple_to_decide is None for row in rows)


def test_compare_runs_ranks_by_asymptote_then_breaks_ties_by_efficiency() -> None:
    compute = np.linspace(100.0, 12_000.0, 120)
    truths = {
        "slow_high": {"a": 0.610, "b": 1.5, "c_mid": 3000.0, "r0": 0.2},
        "fast_low": {"a": 0.600, "b": 2.5, "c_mid": 3000.0, "r0": 0.2},
        "best": {"a": 0.700, "b": 1.8, "c_mid": 3000.0, "r0": 0.2},
        "worst": {"a": 0.450, "b": 3.0, "c_mid": 1500.0, "r0": 0.2},
    }
    runs = {name: (compute, _curve(compute, params), params["r0"]) for name, params in truths.items()}
    rows = compare_runs(runs, CurveFitSettings(), margin=0.02)
    assert [row.name for row in rows] == ["best", "fast_low", "slow_high", "worst"]
    assert [row.rank for row in rows] == [1, 2, 3, 4]
    assert [row.decided_by for row in rows] == ["asymptote", "efficiency", "efficiency", "asymptote"]
    assert rows[1].tie_group == rows[2].tie_group == 2
    assert rows[0].shared_a is None and rows[0].b_at_shared_a is None
    assert rows[1].shared_a == pytest.approx(0.605, abs=1e-5)
    assert rows[2].shared_a == rows[1].shared_a
    assert rows[1].a == pytest.approx(0.600, abs=1e-5)
    assert rows[2].a == pytest.approx(0.610, abs=1e-5)
    # With A nudged by 0.005 each, B moves a little but keeps its order.
    assert rows[1].b_at_shared_a == pytest.approx(2.5, abs=0.2)
    assert rows[2].b_at_shared_a == pytest.approx(1.5, abs=0.2)
    assert rows[3].a == pytest.approx(0.450, abs=1e-5)


def test_equal_asymptotes_are_ranked_by_efficiency_at_the_shared_a() -> None:
    """Two ablations with the same A and different B: the paper refits both at the mean A and ranks by B."""
    compute = np.linspace(100.0, 12_000.0, 120)
    rng = np.random.default_rng(11)
    truths = {
        "recipe-slow": {"a": 0.65, "b": 1.3, "c_mid": 3000.0, "r0": 0.2},
        "recipe-fast": {"a": 0.65, "b": 2.6, "c_mid": 3000.0, "r0": 0.2},
    }
    runs = {
        name: (compute, _curve(compute, params) + rng.normal(0.0, 0.004, compute.size), params["r0"])
        for name, params in truths.items()
    }
    rows = compare_runs(runs, CurveFitSettings(), margin=0.02)
    assert [row.name for row in rows] == ["recipe-fast", "recipe-slow"]
    assert [row.decided_by for row in rows] == ["efficiency", "efficiency"]
    assert rows[0].tie_group == rows[1].tie_group == 1
    assert abs(rows[0].a - rows[1].a) <= 0.02
    assert rows[0].shared_a == rows[1].shared_a == pytest.approx((rows[0].a + rows[1].a) / 2.0)
    assert rows[0].shared_a == pytest.approx(0.65, abs=0.01)
    assert rows[0].b_at_shared_a == pytest.approx(2.6, rel=0.1)
    assert rows[1].b_at_shared_a == pytest.approx(1.3, rel=0.1)
    # The shared-A refit is the fit with A held at the mean: its B is the B of that fit.
    fixed = fit_curve(*runs["recipe-slow"][:2], 0.2, CurveFitSettings(), fixed_a=rows[0].shared_a)
    assert rows[1].b_at_shared_a == fixed.b and rows[1].c_mid_at_shared_a == fixed.c_mid
    # With a margin too small to tie them they are ranked by A alone.
    # With a margin too small to tie them, A alone cannot order them: their intervals overlap.
    apart = compare_runs(runs, CurveFitSettings(), margin=0.0)
    assert [row.decided_by for row in apart] == ["asymptote", "undecided"]
    assert apart[0].a >= apart[1].a and apart[0].rank == apart[1].rank == 1


def test_compare_runs_names_the_run_that_cannot_be_fitted() -> None:
    compute = np.linspace(100.0, 8000.0, 40)
    runs = {
        "good": (compute, _curve(compute, PAPER_DENSE), 0.2),
        "flat": (compute, np.full(compute.size, 0.3), 0.2),
    }
    with pytest.raises(FitError, match="run 'flat': all pass rates equal"):
        compare_runs(runs)
