"""The sweep rule's outcomes on constructed arms whose answers are known (``services.sweep.rule``).

Arms are simulated as ``benchmarks.sweep`` simulates them: known sigmoids measured on one held-out set of
1,000 prompts x 16 samples whose difficulties every arm shares, from one step-0 round (R0 about 0.2), here
every 2% of the budget. Seeds are fixed; where a property is a rate, the bound asserted follows from the
rule's own error rate with the margin said beside it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.sweep import simulate_arms
from services.fitter.curve import CurveFitSettings, Interval
from services.fitter.decision import Decision, decide
from services.sweep.rule import (
    Arm,
    EvalRound,
    SweepSettings,
    Verdict,
    choose,
    fit_arm,
    judge,
    pool,
    prompt_draws,
    seed_spread,
)

ROUNDS = np.arange(1, 51) / 50.0
SETTINGS = SweepSettings(
    warmup_compute=0.1, budget_compute=1.0, num_resamples=50, curve=CurveFitSettings(num_bootstrap_resamples=50)
)
DRAWS = prompt_draws(1000, SETTINGS)


def upto(arm: Arm, look: float) -> Arm:
    """The arm at a look: its rounds up to the first at or past the look's compute."""
    at = min((r.compute for r in arm.rounds if r.compute >= look - 1e-9), default=arm.compute)
    return Arm(arm.name, arm.baseline, tuple(r for r in arm.rounds if r.compute <= at + 1e-9), arm.seed_sd_a)


def verdicts_at(arms: tuple[Arm, ...], compute: float, num_arms: int | None = None) -> dict[str, str]:
    fits = [fit_arm(upto(arm, compute), SETTINGS, DRAWS) for arm in arms]
    return {name: v.outcome for name, v in judge(fits, SETTINGS, num_arms or len(arms)).items()}


def test_the_looks_are_geometric_from_warm_up_and_split_alpha_by_bonferroni() -> None:
    assert SETTINGS.looks == pytest.approx((0.1 * 2**0.5, 0.2, 0.2 * 2**0.5, 0.4, 0.4 * 2**0.5, 0.8, 1.0))
    assert SETTINGS.look_alpha(8) == pytest.approx(0.05 / (7 * 7))
    with pytest.raises(ValueError, match="at least 2 arms"):
        SETTINGS.look_alpha(1)
    assert seed_spread([0.60, 0.62, 0.64]) == pytest.approx(0.02)
    assert seed_spread([0.6]) is None


def test_a_clearly_dominated_arm_is_dominated_and_chosen_against() -> None:
    """A 0.70 against 0.50, both past their bend: a gap ten times the margin plus the widened interval's
    half-width (about 2.45 x 0.021 at 2 arms), so it is dominated at the budget's look."""
    arms = simulate_arms([0.70, 0.50], [2.0, 2.0], [0.2, 0.2], np.random.default_rng(1), ROUNDS)
    fits = [fit_arm(arm, SETTINGS, DRAWS) for arm in arms]
    verdicts = judge(fits, SETTINGS, 2)
    assert verdicts["arm0"].outcome == "leader"
    assert verdicts["arm1"].outcome == "dominated" and verdicts["arm1"].stop
    low, high = verdicts["arm1"].a_difference or (0.0, 0.0)
    assert 0.14 < low < 0.2 < high < 0.26
    assert choose(fits, verdicts) == "arm0"


def test_identical_arms_are_not_dominated() -> None:
    """Twelve pairs of one recipe, each run's A off the recipe's by a seed draw (sd 0.015, as the rule
    assumes), judged at every look. One comparison dominates at most at its error rate 0.05 / 7 and only
    beyond the margin: for a true difference of 0 the chance is about P(Z > (0.02 + 2.45 x 0.021) / 0.021),
    under 0.1% a look, so none of the 84 comparisons may."""
    rng = np.random.default_rng(7)
    dominated = 0
    for _ in range(12):
        realised = 0.62 + rng.normal(0.0, 0.015, 2)
        arms = simulate_arms(realised, [2.0, 2.0], [0.3, 0.3], rng, ROUNDS)
        for look in SETTINGS.looks:
            dominated += sum(outcome == "dominated" for outcome in verdicts_at(arms, look).values())
    assert dominated == 0


def test_an_undetermined_fit_is_never_eliminated() -> None:
    """An arm whose midpoint lies far past the budget (its curve has not bent: A's interval reaches the cap)
    and whose pass rate is far below the leader's at every look: undecided, saying it is not determined."""
    rng = np.random.default_rng(3)
    arms = simulate_arms([0.70, 0.90], [2.0, 1.5], [0.2, 20.0], rng, ROUNDS)
    for look in SETTINGS.looks:
        fits = [fit_arm(upto(arm, look), SETTINGS, DRAWS) for arm in arms]
        verdict = judge(fits, SETTINGS, 2)["arm1"]
        assert verdict.outcome == "undecided", (look, verdict)
        assert "not determined" in verdict.reason or "no fit" in verdict.reason


def with_rounds(arm: Arm, **changes: object) -> Arm:
    return Arm(arm.name, arm.baseline, tuple(EvalRound(**{**vars(r), **changes}) for r in arm.rounds))


def test_an_unstable_arm_is_unstable_not_dominated() -> None:
    """A dominated arm (A 0.50 against 0.70) whose training truncates 20% of completions, one with a NaN,
    and one whose pass rate collapses after a peak: each is "unstable", naming why, never "dominated"."""
    rng = np.random.default_rng(5)
    leader, low = simulate_arms([0.70, 0.50], [2.0, 2.0], [0.2, 0.2], rng, ROUNDS)
    truncating = with_rounds(low, truncation_rate=0.2)
    nan = Arm(low.name, low.baseline, (*low.rounds[:-1], EvalRound(**{**vars(low.rounds[-1]), "finite": False})))
    # The collapse: the last five rounds measure a policy at pass rate 0.3 (the same prompts, fewer right).
    fallen = simulate_arms([0.30], [2.0], [0.001], rng, ROUNDS[-5:])[0].rounds
    collapsed = Arm(low.name, low.baseline, (*low.rounds[:-5], *fallen))
    for arm, kind in ((truncating, "truncation"), (nan, "non_finite"), (collapsed, "collapse")):
        fits = [fit_arm(leader, SETTINGS, DRAWS), fit_arm(arm, SETTINGS, DRAWS)]
        verdict = judge(fits, SETTINGS, 2)["arm1"]
        assert verdict.outcome == "unstable" and verdict.instability is not None, verdict
        assert verdict.instability.kind == kind and verdict.stop
    # Below the thresholds nothing fires: 5% truncation is the paper's healthy range.
    fits = [fit_arm(leader, SETTINGS, DRAWS), fit_arm(with_rounds(low, truncation_rate=0.05), SETTINGS, DRAWS)]
    assert judge(fits, SETTINGS, 2)["arm1"].outcome == "dominated"


def test_residuals_far_above_the_eval_noise_are_not_sigmoidal() -> None:
    """A run whose pass rate steps up and down by 0.05 every round is no sigmoid: its RMSE is about 0.05
    against an eval noise of about 0.003, far past the 3x allowed."""
    rng = np.random.default_rng(9)
    (arm,) = simulate_arms([0.6], [2.0], [0.2], rng, ROUNDS)
    zigzag = simulate_arms([0.55, 0.65], [2.0, 2.0], [0.2, 0.2], rng, ROUNDS)
    rounds = tuple(zigzag[i % 2].rounds[i] for i in range(ROUNDS.size))
    fitted = fit_arm(Arm("zigzag", arm.baseline, rounds), SETTINGS, DRAWS)
    assert fitted.unstable is not None and fitted.unstable.kind == "not_sigmoidal"
    assert fit_arm(arm, SETTINGS, DRAWS).unstable is None


def test_the_paired_interval_is_narrower_than_the_unpaired_one() -> None:
    """Two arms on shared prompts whose difficulties spread (logit sd 1.5): resampling the prompts moves both
    arms' curves together, so the paired interval of A_a - A_b keeps only the samples' own noise. Without the
    seed spread, the paired interval is under a third of the unpaired one's width (measured: about 0.2)."""
    arms = simulate_arms([0.66, 0.60], [2.0, 2.0], [0.2, 0.2], np.random.default_rng(11), ROUNDS)
    fits = [fit_arm(arm, SETTINGS, DRAWS) for arm in arms]
    first, second = ((f.fit, f.paired) for f in fits)
    assert all(f.fit is not None and f.paired is not None for f in fits)
    paired = decide(first, second, 1.0, paired=True).a_difference  # type: ignore[arg-type]
    unpaired = decide(first, second, 1.0, paired=False).a_difference  # type: ignore[arg-type]
    assert paired is not None and unpaired is not None
    assert paired.high - paired.low < (unpaired.high - unpaired.low) / 3
    assert paired.low < 0.06 < paired.high
    # The seed spread widens it by the normal's own quantiles: at least 2 x 1.96 x 0.021 wide.
    widened = decide(first, second, 1.0, paired=True, spread=0.021).a_difference  # type: ignore[arg-type]
    assert widened is not None and widened.high - widened.low > 2 * 1.96 * 0.021


def test_prompt_counts_must_match_the_sweeps_held_out_set() -> None:
    (arm,) = simulate_arms([0.6], [2.0], [0.2], np.random.default_rng(0), ROUNDS, num_prompts=500)
    with pytest.raises(ValueError, match="held-out set has 1000"):
        fit_arm(arm, SETTINGS, DRAWS)


def test_efficiency_picks_only_among_arms_equivalent_on_a() -> None:
    """An arm that projects a higher pass rate at the budget than the leader is picked only when it is
    equivalent to the leader on A; one merely not told apart (undecided) may lie beyond the margin below."""
    arms = simulate_arms([0.66, 0.60], [2.0, 2.0], [0.2, 0.2], np.random.default_rng(11), ROUNDS)
    fits = [fit_arm(arm, SETTINGS, DRAWS) for arm in arms]
    faster = Decision(
        "b_higher", "pass_rate", -0.03, Interval(-0.05, -0.025), Interval(-0.03, 0.05), 1.0, 0.02, 0.05, ""
    )
    verdicts = {"arm0": Verdict("leader", "", "arm0"), "arm1": Verdict("undecided", "", "arm0", faster)}
    assert choose(fits, verdicts) == "arm0"
    verdicts["arm1"] = Verdict("equivalent", "", "arm0", faster)
    assert choose(fits, verdicts) == "arm1"


def test_pooled_seeds_sum_their_step_0_rounds_and_shrink_the_seed_term() -> None:
    arms = simulate_arms([0.6, 0.62], [2.0, 2.0], [0.15, 0.15], np.random.default_rng(3), ROUNDS)
    pooled = pool("recipe", arms, seed_sd_a=0.004)
    assert pooled.seeds == 2 and pooled.baseline.num_samples == 2 * arms[0].baseline.num_samples
    assert np.array_equal(pooled.baseline.correct, arms[0].baseline.correct + arms[1].baseline.correct)
    assert len(pooled.rounds) == 2 * len(arms[0].rounds)
    assert [r.compute for r in pooled.rounds] == sorted(r.compute for a in arms for r in a.rounds)
    # Two seeds' spread below the default does not narrow the term: the default over sqrt(2).
    assert pooled.seed_term(SETTINGS) == pytest.approx(SETTINGS.seed_sd_a / math.sqrt(2))
    assert pool("recipe", arms, seed_sd_a=0.05).seed_term(SETTINGS) == pytest.approx(0.05 / math.sqrt(2))
    assert arms[0].seed_term(SETTINGS) == SETTINGS.seed_sd_a


def test_one_unstable_seed_makes_its_pooled_arm_unstable() -> None:
    good, bad = simulate_arms([0.6, 0.6], [2.0, 2.0], [0.15, 0.15], np.random.default_rng(4), ROUNDS)
    broken = Arm("seed1", bad.baseline, tuple(replace(r, finite=r.compute < 0.5) for r in bad.rounds))
    pooled = pool("recipe", [good, broken])
    fitted = fit_arm(pooled, SETTINGS, DRAWS, [good, broken])
    assert fitted.unstable is not None and fitted.unstable.kind == "non_finite"
    assert fitted.unstable.text.startswith("seed1: ")
    assert fit_arm(pool("recipe", [good, bad]), SETTINGS, DRAWS, [good, bad]).unstable is None
