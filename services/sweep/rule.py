"""The rule that stops a sweep's arms: dominated on A, equivalent, undecided, or unstable.

Owns the sweep's decision at each planned look (docs/recipe.md, "Sweeps"), built on the fitter's own fit
and comparison (``services.fitter.curve``, ``services.fitter.decision.decide``), so that ``asymptote fit``
and a sweep never disagree on what two fits decide:

- An arm is compared on A only once its fit is determined (``decision.determination``, on the fitter's own
  bootstrap) and its compute is past warm-up (the fit's early cutoff); before that it is "undecided".
- The comparison is the interval of A_leader - A_arm, not the overlap of two intervals: a paired
  bootstrap over the held-out prompts (every arm is evaluated on the same prompts, so each resample draws
  the same prompts for every arm and the prompts' shared difficulty cancels), widened by the seed-to-seed
  spread of A (the arm's own replicate seeds when it has them, else ``SEED_SD_A``).
- Dominated: that interval lies above the margin (``decide`` places the leader higher by its asymptote).
  Equivalent: it lies inside (-margin, +margin); the efficiency comparison (the projected pass rate at the
  budget) then orders them. Undecided otherwise: keep running, or add seeds.
- The error rate is split by Bonferroni over the arms compared and the planned looks (``look_alpha``).
- Stops that are not about A are separate and named (``Instability``): a non-finite loss, a truncation
  rate past the one that destabilised the paper's runs, a collapse after a peak, residuals far above the
  eval noise. An unstable arm is "unstable", never "dominated".

Knows nothing about Optuna (``pruner.py``), launchers or files. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator

from asymptote.config import Frozen
from services.fitter.curve import (
    CurveFit,
    CurveFitSettings,
    FitError,
    Interval,
    Intervals,
    bootstrap_intervals,
    fit_curve,
    resampled_intervals,
)
from services.fitter.decision import (
    ALPHA,
    MARGIN,
    MIN_POINTS_DETERMINED,
    Decision,
    Determination,
    decide,
    determination,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

SEED_SD_A = 0.015
"""Standard deviation of A between runs of one recipe that differ only in seed (pass rate), for an arm without
replicate seeds of its own: the paper's +-0.015. Two single-seed arms' difference then carries 0.021 the
bootstrap does not see."""
TRUNCATION_WINDOW = 3
"""Rounds whose training truncation rates are averaged for the truncation stop: one round's spike is noise."""
COLLAPSE_WINDOW = 3
"""Rounds averaged for the collapse stop, for the peak and for the present alike."""

Outcome = Literal["leader", "dominated", "equivalent", "undecided", "unstable"]
"""An arm at a look: the leader (highest determined A), dominated on A by it, equivalent to it within the
margin, undecided (keep running, or add seeds), or unstable (stopped for a reason that is not A)."""
InstabilityKind = Literal["non_finite", "truncation", "collapse", "not_sigmoidal"]


class SweepSettings(Frozen):
    """How a sweep decides its arms: the margin, the error rate, the looks, the stops that are not about A."""

    warmup_compute: float = Field(gt=0.0)
    """Compute before which no arm is judged (the axis's unit): the fit's early cutoff, about one epoch."""
    budget_compute: float = Field(gt=0.0)
    """Compute every arm runs to unless stopped (the axis's unit): the last look, and where efficiency is compared."""
    margin: float = Field(default=MARGIN, gt=0.0, lt=1.0)
    """Delta (pass rate): arms within it are equivalent; an arm is dominated only beyond it."""
    alpha: float = Field(default=ALPHA, gt=0.0, lt=1.0)
    """The sweep's error rate, split over the arms compared and the planned looks (``look_alpha``)."""
    look_ratio: float = Field(default=math.sqrt(2.0), gt=1.0)
    """Planned looks are geometric from the end of warm-up: warm-up x ratio, x ratio^2, ..., then the budget.
    sqrt(2) (7 looks from warm-up at 10%) stops arms soon after their fits are determined; by replay on 60
    simulated sweeps it spent 0.840 of the compute against 0.862 at ratio 2 (4 looks) with the same errors
    and picks, and 1.25 (11 looks) 0.837."""
    seed_sd_a: float = Field(default=SEED_SD_A, ge=0.0)
    """Seed-to-seed standard deviation of A for an arm without replicate seeds (pass rate)."""
    num_resamples: int = Field(default=200, ge=20, le=10_000)
    """Paired bootstrap resamples of the held-out prompts."""
    max_truncation_rate: float = Field(default=0.10, gt=0.0, le=1.0)
    """Unstable past this mean training truncation rate over the last rounds (10-15% destabilised the paper's runs)."""
    collapse_drop: float = Field(default=0.05, gt=0.0, lt=1.0)
    """Unstable when the pass rate (mean of 3 rounds) falls this far below its peak past warm-up (pass rate)."""
    max_residual_ratio: float = Field(default=3.0, gt=1.0)
    """Unstable when the fit's RMSE exceeds this many times the eval noise the counts imply: not a sigmoid."""
    rng_seed: int = 0
    """Seed of the prompt resamples (every arm gets the same draws, at every look)."""
    curve: CurveFitSettings = CurveFitSettings()
    """The fitter's curve settings; the early cutoff is always the warm-up compute."""

    @model_validator(mode="after")
    def _check_budget(self) -> SweepSettings:
        if self.warmup_compute >= self.budget_compute:
            raise ValueError(
                f"warmup_compute {self.warmup_compute:g} must be below budget_compute {self.budget_compute:g}"
            )
        return self

    @property
    def looks(self) -> tuple[float, ...]:
        """The planned looks' compute: warm-up x ratio^k below the budget, then the budget."""
        looks: list[float] = []
        compute = self.warmup_compute * self.look_ratio
        while compute < self.budget_compute * (1 - 1e-9):
            looks.append(compute)
            compute *= self.look_ratio
        return (*looks, self.budget_compute)

    @property
    def fit_settings(self) -> CurveFitSettings:
        """The curve settings with the warm-up as the fit's early cutoff."""
        return self.curve.model_copy(update={"early_cutoff": "compute", "early_cutoff_compute": self.warmup_compute})

    def look_alpha(self, num_arms: int) -> float:
        """One comparison's one-sided error rate: alpha / ((arms - 1) x looks) (Bonferroni).

        The looks see nested data and the arms share a leader and prompts; Bonferroni holds under any such
        dependence and needs no information fraction (which a sigmoid's A does not have: it is all but
        unidentified until the curve bends, then pinned quickly).
        """
        if num_arms < 2:
            raise ValueError(f"a sweep compares at least 2 arms, got {num_arms}")
        return self.alpha / ((num_arms - 1) * len(self.looks))


@dataclass(frozen=True, eq=False)
class EvalRound:
    """One eval round of one arm: per held-out prompt, how many of its samples were correct."""

    compute: float
    """Cumulative training compute at the round (the axis's unit); 0 for the step-0 round (R0)."""
    correct: IntArray
    """Correct samples of each held-out prompt, in the prompt order the whole sweep shares."""
    num_samples: int
    """Samples per prompt."""
    truncation_rate: float | None = None
    """Fraction of training completions truncated since the previous round; None when not reported."""
    finite: bool = True
    """Every loss and gradient norm since the previous round was finite."""

    @property
    def pass_rate(self) -> float:
        return float(self.correct.sum()) / (self.correct.size * self.num_samples)

    @property
    def noise_var(self) -> float:
        """Variance of the round's pass rate from its samples alone (the prompts held fixed): sum of each
        prompt's p(1 - p) / k over P^2, with p(1 - p) estimated unbiasedly from c of k correct."""
        k, num_prompts = self.num_samples, self.correct.size
        if k < 2:
            rate = self.pass_rate
            return rate * (1.0 - rate) / num_prompts
        c = self.correct.astype(np.float64)
        return float((c * (k - c)).sum() / (k * (k - 1))) / (num_prompts**2 * k)


@dataclass(frozen=True, eq=False)
class Arm:
    """One arm of a sweep as a look sees it: its step-0 round and its eval rounds so far, in compute order."""

    name: str
    baseline: EvalRound
    """The step-0 round: R0."""
    rounds: tuple[EvalRound, ...]
    seed_sd_a: float | None = None
    """Seed-to-seed standard deviation of A from this arm's replicate seeds (``seed_spread``); None: the default."""
    seeds: int = 1
    """Runs pooled into the arm (``pool``): its A is their mean curve's, its seed term shrinks by sqrt(seeds)."""

    @property
    def compute(self) -> float:
        return self.rounds[-1].compute if self.rounds else 0.0

    def seed_term(self, settings: SweepSettings) -> float:
        """The seed-to-seed spread of this arm's A that the prompt bootstrap does not see: the larger of its
        replicates' spread and the default (two or three seeds cannot show a spread below the default with
        any confidence), over sqrt(seeds) for an arm that pools its seeds."""
        spread = settings.seed_sd_a if self.seed_sd_a is None else max(self.seed_sd_a, settings.seed_sd_a)
        return spread / math.sqrt(self.seeds)


def pool(name: str, seed_arms: Sequence[Arm], seed_sd_a: float | None = None) -> Arm:
    """One arm of the runs of one recipe that differ only in seed: their step-0 rounds summed prompt by prompt
    (the same model on the same prompts), their rounds together in compute order (one curve through all the
    seeds' points: the recipe's mean curve)."""
    if not seed_arms:
        raise ValueError(f"arm {name!r}: no runs to pool")
    baselines = [a.baseline for a in seed_arms]
    sizes = {b.correct.size for b in baselines}
    if len(sizes) != 1:
        raise ValueError(f"arm {name!r}: step-0 rounds of {sorted(sizes)} prompts; its seeds share one held-out set")
    baseline = EvalRound(
        0.0,
        np.sum([b.correct for b in baselines], axis=0).astype(np.int64),
        sum(b.num_samples for b in baselines),
    )
    rounds = sorted((r for a in seed_arms for r in a.rounds), key=lambda r: r.compute)
    return Arm(name, baseline, tuple(rounds), seed_sd_a, len(seed_arms))


def seed_spread(replicate_a: Sequence[float]) -> float | None:
    """The seed-to-seed standard deviation of A from the fitted A's of an arm's replicate seeds (n - 1 in the
    denominator); None with fewer than two."""
    values = np.asarray(replicate_a, dtype=np.float64)
    return float(values.std(ddof=1)) if values.size >= 2 else None


class Instability(NamedTuple):
    """Why an arm stopped for a reason that is not its A."""

    kind: InstabilityKind
    text: str


def prompt_draws(num_prompts: int, settings: SweepSettings) -> FloatArray:
    """The paired bootstrap's resamples: how often each held-out prompt is drawn in each (K x P), the same
    for every arm and every look."""
    rng = np.random.default_rng(settings.rng_seed)
    counts = rng.multinomial(num_prompts, np.full(num_prompts, 1.0 / num_prompts), size=settings.num_resamples)
    draws: FloatArray = counts.astype(np.float64)
    return draws


def instability(arm: Arm, settings: SweepSettings) -> Instability | None:
    """The first stop that is not about A that ``arm`` meets before any fit: non-finite, truncation, collapse."""
    for r in arm.rounds:
        if not r.finite:
            return Instability("non_finite", f"a non-finite loss or gradient norm before compute {r.compute:.4g}")
    rates = [r.truncation_rate for r in arm.rounds if r.truncation_rate is not None]
    if len(rates) >= TRUNCATION_WINDOW:
        recent = float(np.mean(rates[-TRUNCATION_WINDOW:]))
        if recent > settings.max_truncation_rate:
            return Instability(
                "truncation",
                f"truncation rate {recent:.1%} over the last {TRUNCATION_WINDOW} rounds, above "
                f"{settings.max_truncation_rate:.0%}",
            )
    past = np.array([r.pass_rate for r in arm.rounds if r.compute >= settings.warmup_compute])
    if past.size >= COLLAPSE_WINDOW:
        smooth = np.convolve(past, np.full(COLLAPSE_WINDOW, 1.0 / COLLAPSE_WINDOW), mode="valid")
        drop = float(smooth.max() - smooth[-1])
        if drop > settings.collapse_drop:
            return Instability(
                "collapse",
                f"pass rate {smooth[-1]:.3f} is {drop:.3f} below its peak {smooth.max():.3f} "
                f"(means of {COLLAPSE_WINDOW} rounds), more than {settings.collapse_drop:g}",
            )
    return None


def not_sigmoidal(fit: CurveFit, used: Sequence[EvalRound], settings: SweepSettings) -> Instability | None:
    """Residuals far above the eval noise the counts imply: the curve is not the sigmoid the rule reads."""
    if fit.num_points_used < MIN_POINTS_DETERMINED:
        return None
    noise_sd = math.sqrt(float(np.mean([r.noise_var for r in used])))
    if fit.rmse > settings.max_residual_ratio * noise_sd:
        return Instability(
            "not_sigmoidal",
            f"the fit's RMSE {fit.rmse:.4f} is {fit.rmse / noise_sd:.1f}x the eval noise {noise_sd:.4f} "
            f"(at most {settings.max_residual_ratio:g}x): the curve is not a sigmoid",
        )
    return None


@dataclass(frozen=True, eq=False)
class ArmFit:
    """An arm at a look: its fit, the fitter's own intervals, the paired intervals, and what keeps it from
    being compared (nothing, an instability, no fit yet, a fit that is not determined)."""

    arm: Arm
    fit: CurveFit | None = None
    intervals: Intervals | None = None
    """The fitter's own bootstrap (``bootstrap_intervals``): what ``determination`` reads, as ``asymptote fit``."""
    paired: Intervals | None = None
    """The paired prompt bootstrap (``resampled_intervals``), row-aligned with every other arm's."""
    judged: Determination | None = None
    unstable: Instability | None = None
    why_not: str = ""
    """Why the arm cannot be compared on A (warming up, no fit, not determined); empty when it can."""

    @property
    def comparable(self) -> bool:
        return self.unstable is None and not self.why_not


def resampled_rates(rounds: Sequence[EvalRound], draws: FloatArray) -> FloatArray:
    """Each round's pass rate in each prompt resample (K x rounds)."""
    correct = np.stack([r.correct for r in rounds], axis=1).astype(np.float64)  # (P, R)
    totals = np.array([r.correct.size * r.num_samples for r in rounds], dtype=np.float64)
    rates: FloatArray = (draws @ correct) / totals
    return rates


def fit_arm(arm: Arm, settings: SweepSettings, draws: FloatArray, seed_arms: Sequence[Arm] = ()) -> ArmFit:
    """Fit ``arm`` as a look does: stops that are not about A first, then the fitter's fit, its own
    bootstrap and determination, then (for a determined fit) the paired intervals on ``draws``.

    ``seed_arms``: the runs ``arm`` pools (``pool``), each checked for the stops that are not about A on its
    own (a collapse or a truncation streak is one run's, and interleaved seeds would blur it); an arm with
    one unstable seed is unstable. Without them ``arm`` is one run, checked as it is.
    """
    for seed_arm in seed_arms or (arm,):
        unstable = instability(seed_arm, settings)
        if unstable is not None:
            text = f"{seed_arm.name}: {unstable.text}" if seed_arms else unstable.text
            return ArmFit(arm, unstable=Instability(unstable.kind, text))
    first_look = settings.looks[0]
    if arm.compute < first_look:
        return ArmFit(arm, why_not=f"warming up: compute {arm.compute:.4g}, first look at {first_look:.4g}")
    sizes = {r.correct.size for r in (arm.baseline, *arm.rounds)}
    if sizes != {draws.shape[1]}:
        raise ValueError(
            f"arm {arm.name!r}: rounds of {sorted(sizes)} prompts; the sweep's held-out set has {draws.shape[1]}"
        )
    fit_settings = settings.fit_settings
    compute = np.array([r.compute for r in arm.rounds])
    pass_rate = np.array([r.pass_rate for r in arm.rounds])
    r0 = arm.baseline.pass_rate
    try:
        fit = fit_curve(compute, pass_rate, r0, fit_settings)
        if fit.num_points_used < MIN_POINTS_DETERMINED:
            # Not determined whatever its intervals say: the bootstrap would be spent for nothing.
            why = f"not determined: {fit.num_points_used} points used, at least {MIN_POINTS_DETERMINED}"
            return ArmFit(arm, fit, why_not=why)
        intervals = bootstrap_intervals(compute, pass_rate, r0, fit_settings, fit)
    except FitError as error:
        return ArmFit(arm, why_not=f"no fit: {error}")
    used = [r for r in arm.rounds if r.compute >= fit.cutoff_compute]
    unstable = not_sigmoidal(fit, used, settings)
    if unstable is not None:
        return ArmFit(arm, fit, intervals, unstable=unstable)
    judged = determination(fit, intervals)
    if not judged.determined:
        return ArmFit(arm, fit, intervals, judged=judged, why_not=f"not determined: {judged.why_not}")
    paired = resampled_intervals(
        compute, pass_rate, resampled_rates(arm.rounds, draws), r0, fit_settings, fit, [settings.budget_compute]
    )
    return ArmFit(arm, fit, intervals, paired, judged)


@dataclass(frozen=True)
class Verdict:
    """One arm's outcome at a look, with the comparison that settled it."""

    outcome: Outcome
    reason: str
    leader: str | None = None
    decision: Decision | None = None
    """``decide``'s answer, leader first ("a") and this arm second ("b"); None where nothing was compared."""
    instability: Instability | None = None

    @property
    def stop(self) -> bool:
        """The arm stops: dominated on A, or unstable."""
        return self.outcome in ("dominated", "unstable")

    @property
    def a_difference(self) -> Interval | None:
        """The interval of A_leader - A_arm that settled it, paired and widened by the seeds."""
        return None if self.decision is None else self.decision.a_difference


def judge(fits: Sequence[ArmFit], settings: SweepSettings, num_arms: int) -> dict[str, Verdict]:
    """Every arm's outcome at a look, from the fits of the arms still running (``fit_arm`` on shared draws).

    The leader is the comparable arm with the highest fitted A; every other comparable arm is compared with
    it by ``decide`` (leader first) on the paired intervals, widened by both arms' seed spread, at the
    one-sided error rate ``look_alpha(num_arms)`` (``decide``'s two-sided interval at twice it), with the
    pass rates compared at the budget. ``num_arms`` is the sweep's planned number of arms.
    """
    alpha_look = settings.look_alpha(num_arms)
    verdicts: dict[str, Verdict] = {}
    for f in fits:
        if f.unstable is not None:
            verdicts[f.arm.name] = Verdict(
                "unstable", f"unstable ({f.unstable.kind}): {f.unstable.text}", None, None, f.unstable
            )
    comparable = [f for f in fits if f.comparable]
    leader = max(comparable, key=lambda f: f.fit.a if f.fit is not None else -math.inf, default=None)
    for f in fits:
        name = f.arm.name
        if name in verdicts:
            continue
        if leader is None:
            verdicts[name] = Verdict("undecided", f"{f.why_not or 'comparable'}; no arm is determined to lead yet")
            continue
        if f is leader:
            verdicts[name] = Verdict("leader", f"leader: the highest determined A, {_a_text(f)}", name)
            continue
        if not f.comparable:
            verdicts[name] = Verdict("undecided", f.why_not, leader.arm.name)
            continue
        verdicts[name] = _compare(leader, f, settings, alpha_look)
    return verdicts


def _a_text(f: ArmFit) -> str:
    assert f.fit is not None and f.intervals is not None
    return f"A {f.fit.a:.3f} [{f.intervals.a.low:.3f}, {f.intervals.a.high:.3f}]"


def _compare(leader: ArmFit, arm: ArmFit, settings: SweepSettings, alpha_look: float) -> Verdict:
    assert leader.fit is not None and leader.paired is not None and arm.fit is not None and arm.paired is not None
    spread = math.hypot(leader.arm.seed_term(settings), arm.arm.seed_term(settings))
    decision = decide(
        (leader.fit, leader.paired),
        (arm.fit, arm.paired),
        settings.budget_compute,
        settings.margin,
        min(2.0 * alpha_look, 0.5),
        paired=True,
        spread=spread,
    )
    name = leader.arm.name
    a_diff = decision.a_difference
    if decision.outcome == "a_higher" and decision.decided_by == "asymptote":
        return Verdict("dominated", f"dominated by {name}: {decision.reason}", name, decision)
    if decision.outcome == "undecided" and decision.decided_by == "determination":
        return Verdict("undecided", decision.reason, name, decision)
    assert a_diff is not None
    shown = f"A_{name} - A {a_diff.low:+.3f}..{a_diff.high:+.3f} (paired, seed spread {spread:.3f})"
    if -settings.margin < a_diff.low and a_diff.high < settings.margin:
        return Verdict(
            "equivalent", f"equivalent to {name} on A, {shown}; by efficiency: {decision.reason}", name, decision
        )
    return Verdict(
        "undecided", f"undecided against {name}: {shown}, neither beyond nor within the margin", name, decision
    )


def choose(fits: Sequence[ArmFit], verdicts: Mapping[str, Verdict]) -> str | None:
    """The arm a sweep picks: the leader (the highest determined A), unless an arm equivalent to it on A
    projects a higher pass rate at the budget by more than the margin (``decide``'s efficiency step); None
    without a leader.

    Efficiency orders only arms told to be equivalent on A: an arm merely not told apart from the leader
    (undecided) may still lie more than the margin below it, and picking it for its early pass rate lost
    sweeps whose highest-A arm was the leader (4 of 70 simulated sweeps).
    """
    leader = next((name for name, v in verdicts.items() if v.outcome == "leader"), None)
    if leader is None:
        return None
    alive = {f.arm.name for f in fits if f.unstable is None}
    better = [
        (v.decision.difference or 0.0, name)
        for name, v in verdicts.items()
        if v.outcome == "equivalent" and v.decision is not None and v.decision.outcome == "b_higher" and name in alive
    ]
    return min(better)[1] if better else leader
