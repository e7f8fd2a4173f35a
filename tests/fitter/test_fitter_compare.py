"""Comparisons that decide only what the data decide (``decision.decide``, ``decision.compare_runs``).

Pairs of runs simulated as the fitter sees them: a known sigmoid measured by
held-out rounds of 200 prompts x 4 samples (each prompt's correct count
binomial), at versions 0, 10, ..., 300 (31 rounds, the first R0's). Two runs
of one curve must come out "decided" (one above the other) at most at the
stated error rate (5%); two runs 0.06 apart in A must be decided the right
way round in at least 80% of pairs whose fits are both determined; a fit
that is not determined is never ranked. The rule these replace ordered
runs within the margin by B's point estimate: two runs of one curve were
"decided" nearly always.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from services.fitter.curve import CurveFitSettings, bootstrap_intervals, fit_curve, predict
from services.fitter.decision import MARGIN, compare_runs, determination, summary_line

NUM_PROMPTS, NUM_SAMPLES = 200, 4
VERSIONS = np.arange(0, 301, 10)
COMPUTE_PER_VERSION = 1.0e12
"""FLOPs per policy version."""
CURVE = {"b": 1.8, "c_mid_version": 80.0, "r0": 0.25}
"""Half the gain by version 80, so that 300 versions pass the bend and the fits are determined."""
SETTINGS = CurveFitSettings()
NUM_PAIRS = 200
ERROR_RATE = 0.05
"""The stated error rate (``decision.ALPHA``), held here so that these tests run, and fail, on the old rule."""

Run = tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], float]


def simulated(a: float, seed: int) -> Run:
    """One run's curve points after R0, and R0, each round's pass rate measured over 200 prompts x 4 samples."""
    rng = np.random.default_rng(seed)
    compute = (VERSIONS * COMPUTE_PER_VERSION).astype(np.float64)
    rate = np.full(VERSIONS.size, CURVE["r0"])
    rate[1:] = predict(compute[1:], a, CURVE["b"], CURVE["c_mid_version"] * COMPUTE_PER_VERSION, CURVE["r0"])
    measured = rng.binomial(NUM_SAMPLES, np.repeat(rate[:, None], NUM_PROMPTS, axis=1)).sum(axis=1)
    pass_rate = (measured / (NUM_PROMPTS * NUM_SAMPLES)).astype(np.float64)
    return compute[1:], pass_rate[1:], float(pass_rate[0])


def outcomes(a_first: float, a_second: float, num_pairs: int, seed: int) -> dict[str, int]:
    """How ``compare_runs`` answers ``num_pairs`` simulated pairs: "decided" the right way (first above when
    its A is higher, or either way for equal A's), "wrong", "equivalent", "undecided", and pairs whose fits
    were both determined ("determined")."""
    counts = dict.fromkeys(("right", "wrong", "equivalent", "undecided", "determined"), 0)
    for pair in range(num_pairs):
        runs = {"first": simulated(a_first, seed + 2 * pair), "second": simulated(a_second, seed + 2 * pair + 1)}
        rows = compare_runs(runs, SETTINGS)
        said = summary_line(rows)
        counts["determined"] += all(row.rank is not None for row in rows)
        if said.startswith("decided: first > second"):
            counts["right"] += 1
        elif said.startswith("decided: second > first"):
            counts["right" if a_first == a_second else "wrong"] += 1
        elif said.startswith("equivalent"):
            counts["equivalent"] += 1
        else:
            counts["undecided"] += 1
    return counts


def test_runs_of_one_recipe_are_not_told_apart() -> None:
    """Twelve pairs of one curve: at most one is "decided" (here one, on an A interval 0.04-0.25 apart; the
    slow test below measures the rate); the old rule, B's point estimate within the margin, decided 10."""
    counts = outcomes(0.60, 0.60, 12, seed=100)
    assert counts["determined"] == 12
    assert counts["right"] + counts["wrong"] <= 1, counts


@pytest.mark.slow  # 400 fits with bootstrap intervals: about half a minute
def test_at_most_the_error_rate_of_identical_pairs_is_decided(capsys: pytest.CaptureFixture[str]) -> None:
    counts = outcomes(0.60, 0.60, NUM_PAIRS, seed=1000)
    decided = counts["right"] + counts["wrong"]
    with capsys.disabled():
        print(f"\nidentical pairs: {counts}; decided {decided}/{NUM_PAIRS}")
    assert decided <= ERROR_RATE * NUM_PAIRS


@pytest.mark.slow  # 400 fits with bootstrap intervals: about half a minute
def test_a_real_gap_of_0_06_is_decided_the_right_way(capsys: pytest.CaptureFixture[str]) -> None:
    counts = outcomes(0.66, 0.60, NUM_PAIRS, seed=5000)
    with capsys.disabled():
        print(f"\npairs 0.06 apart in A: {counts}")
    assert counts["determined"] >= 0.9 * NUM_PAIRS
    assert counts["right"] >= 0.8 * counts["determined"]
    assert counts["wrong"] <= ERROR_RATE * NUM_PAIRS


def _fitted(run: Run) -> tuple[object, ...]:
    compute, pass_rate, r0 = run
    fit = fit_curve(compute, pass_rate, r0, SETTINGS)
    return fit, bootstrap_intervals(compute, pass_rate, r0, SETTINGS, fit)


def test_an_undetermined_fit_is_never_ranked() -> None:
    """A run whose midpoint lies past its points (its A's interval reaches the cap) against a determined one far
    below it: the comparison does not place either, and says which fit is not determined."""
    compute, _, _ = simulated(0.6, 0)
    rng = np.random.default_rng(3)
    open_run = (
        compute,
        np.clip(
            predict(compute, 0.95, 1.2, 2000 * COMPUTE_PER_VERSION, 0.25) + rng.normal(0, 0.005, compute.size), 0, 1
        ),
        0.25,
    )
    runs = {"open": open_run, "steady": simulated(0.45, 7)}
    fitted = {name: _fitted(run) for name, run in runs.items()}
    assert not determination(*fitted["open"]).determined  # type: ignore[arg-type]
    assert determination(*fitted["steady"]).determined  # type: ignore[arg-type]
    rows = compare_runs(runs, SETTINGS)
    by_name = {row.name: row for row in rows}
    assert by_name["open"].rank is None and by_name["open"].verdict.startswith("not ranked: not determined: ")
    assert rows[-1].name == "open"
    decision = by_name["steady"].decisions["open"]
    assert (decision.outcome, decision.decided_by, decision.interval) == ("undecided", "determination", None)
    assert decision.reason.startswith("b not determined: ")
    assert (
        summary_line(rows) == "undecided: steady vs open (b not determined: " + decision.reason.split(": ", 1)[1] + ")"
    )


def test_decide_states_the_outcome_and_the_interval_that_settled_it() -> None:
    """By asymptote when A's difference interval clears the margin; by the pass rate at the target otherwise;
    equivalent when that difference lies inside the margin."""
    from services.fitter.decision import ALPHA, decide

    assert ALPHA == ERROR_RATE
    far = _fitted(simulated(0.75, 11)), _fitted(simulated(0.60, 12))
    target = float(VERSIONS[-1] * COMPUTE_PER_VERSION)
    by_a = decide(*far, target)  # type: ignore[arg-type]
    assert (by_a.outcome, by_a.decided_by) == ("a_higher", "asymptote")
    assert by_a.interval is not None and by_a.interval.low > MARGIN and by_a.interval == by_a.a_difference
    assert by_a.difference is not None and by_a.difference > 0.08  # 0.15 apart in truth
    assert by_a.reason.startswith(f"A {by_a.difference:+.3f} [") and "at 95%, beyond the margin 0.02" in by_a.reason
    assert decide(far[1], far[0], target).outcome == "b_higher"  # type: ignore[arg-type]
    # Noiseless copies of one curve: every bootstrap sample is the curve, the difference is 0 throughout.
    compute = VERSIONS[1:] * COMPUTE_PER_VERSION
    exact = (compute, predict(compute, 0.6, 1.8, 80 * COMPUTE_PER_VERSION, 0.25), 0.25)
    same = decide(_fitted(exact), _fitted(exact), target)  # type: ignore[arg-type]
    assert (same.outcome, same.decided_by) == ("equivalent", "pass_rate")
    assert same.interval is not None and -MARGIN <= same.interval.low <= same.interval.high <= MARGIN
    assert "within the margin 0.02" in same.reason and same.reason.startswith("pass rate at 300 TFLOP +0.000 [")
    with pytest.raises(ValueError, match="alpha must be an error rate"):
        decide(_fitted(exact), _fitted(exact), target, alpha=0.0)  # type: ignore[arg-type]
