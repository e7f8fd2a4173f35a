"""What a fit lets one decide: recommendations and the recipe comparison.

The recommendation's three answers (continue, stop, compare) and its
refusal to project a fit at its bound, with numbers; the comparison ranks
only determined fits, decides by A where A's difference clears the
margin, by the pass rate at the target where it does not, and answers
"equivalent" or "undecided" otherwise (the error rates over simulated pairs
are in test_fitter_compare.py).
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
from services.fitter.decision import compare_runs, recommend, summary_line

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
    assert "within 0.02 of dapo: compare them" in advice.reason and "gspo" not in advice.reason
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


def test_comparison_does_not_rank_a_run_at_its_bound() -> None:
    """The case of a run at A's bound ranked above a determined one: now it is not ranked at all."""
    compute = np.linspace(500.0, 20_000.0, 40)
    runs = {
        "at-bound": (compute, predict(compute, 0.9, 1.9, 2542.0, 0.2), 0.2),
        "steady": (compute, _noisy(compute, 0.67, 0.005, 1), 0.2),
    }
    rows = compare_runs(runs, PAPER_A_RANGE, compute_unit="device_seconds")
    by_name = {row.name: row for row in rows}
    assert by_name["at-bound"].a == pytest.approx(0.8) and not by_name["at-bound"].identifiable
    assert by_name["at-bound"].rank is None and not by_name["at-bound"].determined
    assert by_name["at-bound"].verdict == ("not ranked: not determined: A at the bound of the search range: run longer")
    assert by_name["steady"].rank == 1 and by_name["steady"].determined
    assert rows[-1].name == "at-bound"  # unranked runs come last, whatever their A
    assert summary_line(rows) == (
        "undecided: steady vs at-bound (b not determined: A at the bound of the search range: run longer)"
    )


def test_comparison_is_undecided_when_the_intervals_straddle_the_margin() -> None:
    # Short, noisy runs 0.05 apart in A: their difference's interval reaches both inside and beyond the margin.
    compute = np.linspace(200.0, 4000.0, 20)
    runs = {"hi": (compute, _noisy(compute, 0.66, 0.01, 2), 0.2), "lo": (compute, _noisy(compute, 0.61, 0.01, 3), 0.2)}
    rows = compare_runs(runs, compute_unit="device_seconds")
    hi, lo = rows
    assert {hi.name, lo.name} == {"hi", "lo"} and hi.rank == lo.rank == 1
    decision = hi.decisions[lo.name]
    assert (decision.outcome, decision.decided_by) == ("undecided", "pass_rate")
    assert decision.interval is not None and decision.interval.low < 0.02 < decision.interval.high
    assert decision.a_difference is not None and decision.a_difference.low < 0.02
    said = summary_line(rows)
    assert said.startswith(f"undecided: {hi.name} vs {lo.name} (pass rate at 1.11 device-hours ") and "neither" in said


def test_comparison_decides_by_asymptote_when_the_a_difference_clears_the_margin() -> None:
    compute = np.linspace(200.0, 16_000.0, 80)
    runs = {
        "lo": (compute, _noisy(compute, 0.61, 0.005, 3), 0.2),
        "hi": (compute, _noisy(compute, 0.66, 0.005, 2), 0.2),
    }
    rows = compare_runs(runs, compute_unit="device_seconds")
    assert [(row.name, row.rank) for row in rows] == [("hi", 1), ("lo", 2)]
    decision = rows[0].decisions["lo"]
    assert (decision.outcome, decision.decided_by) == ("a_higher", "asymptote")
    assert decision.interval is not None and decision.interval.low > 0.02
    assert rows[0].a == pytest.approx(0.66, abs=0.01) and rows[1].a == pytest.approx(0.61, abs=0.01)
    assert summary_line(rows).startswith("decided: hi > lo (A +0.0")
    assert rows[1].verdict.startswith("below hi (A -0.0")


def test_compare_runs_ranks_by_asymptote_then_by_the_pass_rate_reached() -> None:
    """Noiseless curves: A decides where asymptotes differ by more than the margin, the pass rate at the
    compute both reached where they do not (0.600 reaches 0.588 by 4x C_mid with B 2.5, 0.610 only 0.564 with
    B 1.5)."""
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
    assert rows[1].decisions["slow_high"].decided_by == "pass_rate"
    assert rows[1].decisions["slow_high"].difference == pytest.approx(0.0235, abs=0.001)
    assert rows[0].decisions["fast_low"].decided_by == "asymptote"
    assert rows[1].target_compute == 12_000.0
    assert summary_line(rows) == "decided: best > fast_low > slow_high > worst"


def test_equal_asymptotes_are_ordered_by_the_pass_rate_they_reach() -> None:
    """Two ablations with the same A and different B: the faster is ahead at the compute both reached."""
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
    decision = rows[0].decisions["recipe-slow"]
    assert (decision.outcome, decision.decided_by) == ("a_higher", "pass_rate")
    assert decision.difference == pytest.approx(0.052, abs=0.01)
    # At a budget far past the bend both are at their shared A: equivalent there.
    far = compare_runs(runs, CurveFitSettings(), margin=0.02, target_compute=1e7)
    assert far[0].decisions[far[1].name].outcome == "equivalent"
    assert summary_line(far).startswith("equivalent: ")


def test_compare_runs_names_the_run_that_cannot_be_fitted() -> None:
    compute = np.linspace(100.0, 8000.0, 40)
    runs = {
        "good": (compute, _curve(compute, PAPER_DENSE), 0.2),
        "flat": (compute, np.full(compute.size, 0.3), 0.2),
    }
    with pytest.raises(FitError, match="run 'flat': all pass rates equal"):
        compare_runs(runs)
