"""What a fit lets one decide: continue, stop or compare a run; rank recipes or not.

Owns the decisions of docs/recipe.md, "The compute-performance curve", built on ``curve.py``'s fits and
bootstrap intervals (ScaleRL, arXiv 2510.13786): whether a fit is
determined (``determination``: the one rule every reader of a fit uses), a
run's recommendation at its planned compute budget, and the recipe
comparison (``decide``: two fits, their intervals, a margin and an error
rate in, "a_higher", "b_higher", "equivalent" or "undecided" out, with the
interval that settled it), which ranks only determined fits and decides
only what the intervals decide. Knows nothing about files, NATS or
Prometheus. Torch-free.

The margin is the paper's +-0.02 on A, measured between repeated runs of
one recipe: gains and differences within it are not told apart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import numpy as np
import numpy.typing as npt
from scipy.optimize import brentq
from scipy.special import ndtr

from asymptote.compute import ComputeUnit, compute_text
from services.fitter.curve import (
    CurveFit,
    CurveFitSettings,
    FitError,
    Interval,
    Intervals,
    bootstrap_intervals,
    fit_curve,
    predict,
)

MARGIN = 0.02
"""The paper's run-to-run spread of A (pass rate): differences within it are noise."""
A_BOUND_TOLERANCE = 0.005
"""An end of A's interval within this of a bound of A's search range reaches it (pass rate): one step of
the paper's A grid, the finest the fit resolves A, so an end that close cannot be told from the bound."""
MAX_C_MID_SPREAD = 10.0
"""Widest C_mid interval (high / low) of a determined fit: one decade of compute, the midpoint placed to
within about 3.2x either way. The paper extrapolated 2x to 3x past its data (50k to 100k GPU-hours, 16k to
45k, 8k to 16k): a midpoint less certain than that leaves open on which side of it such a projection lands.
On simulated runs (200 prompts x 4 samples per eval round, every 10 versions to 300) a fit whose points
have passed the midpoint typically spans 1.3x to 7x; one whose midpoint still lies past its points, tens to
tens of thousands."""
MIN_POINTS_DETERMINED = 8
"""Fewest points used by a determined fit. The residual bootstrap learns the noise from the n - 3 residuals
of the fit: with 4 to 6 points a lucky near-exact fit gives an interval many times too narrow. On simulated
runs (as above, 400 runs) the last fit's 95% interval for A held the true A in 80% of runs with 5 points,
90% with 7 and 91-94% with 10 to 30; the only consecutive fits whose A intervals were disjoint had 5 or 6
points, and none of 2,640 consecutive pairs from 8 points on was (120 runs)."""

Action = Literal["continue", "stop", "compare"]
NotDeterminedKind = Literal["few_points", "at_bound", "a_at_cap", "a_at_floor", "c_mid_spread"]
NOT_DETERMINED_KINDS: tuple[NotDeterminedKind, ...] = get_args(NotDeterminedKind)
"""What can keep a fit from being determined, as the gauge ``asymptote_fitter_not_determined{reason}`` names it."""


class Shortfall(NamedTuple):
    """One thing that keeps a fit from being determined, and what would determine it."""

    kind: NotDeterminedKind
    text: str


@dataclass(frozen=True)
class Determination:
    """Whether a fit is determined (``determination``) and, if not, why."""

    shortfalls: tuple[Shortfall, ...]

    @property
    def determined(self) -> bool:
        """Nothing keeps the fit from being read: its A, its projection and the advice off them mean something."""
        return not self.shortfalls

    @property
    def why_not(self) -> str:
        """What keeps the fit from being determined and what would determine it; empty when determined."""
        return "; ".join(shortfall.text for shortfall in self.shortfalls)


def determination(fit: CurveFit, intervals: Intervals) -> Determination:
    """Whether ``fit`` is determined: the rule the progress line, fit.json, the gauges and ``recommend`` share.

    A fit is determined when all four hold:

    - it used at least ``MIN_POINTS_DETERMINED`` points;
    - no parameter ended on a bound of its search range (``CurveFit.identifiable``);
    - A's bootstrap interval lies strictly inside A's search range: neither end within
      ``A_BOUND_TOLERANCE`` of the cap (``a_max``, 1.0 by default) or of the floor (R0 or ``a_min``).
      An interval that reaches the cap says only "A is at least ...": any gain read off its upper end
      is the search range's, not the data's. One that reaches R0 leaves "no gain at all" open;
    - C_mid's interval spans at most ``MAX_C_MID_SPREAD`` (high / low).

    A fit with A held fixed (the recipe comparison) has no A interval to judge: the other three apply.
    """
    shortfalls: list[Shortfall] = []
    if fit.num_points_used < MIN_POINTS_DETERMINED:
        shortfalls.append(
            Shortfall(
                "few_points",
                f"{fit.num_points_used} points used, at least {MIN_POINTS_DETERMINED}: more eval rounds",
            )
        )
    if fit.params_at_bounds:
        names = ", ".join(fit.params_at_bounds)
        shortfalls.append(Shortfall("at_bound", f"{names} at the bound of the search range: run longer"))
    a_low, a_high = intervals.a
    floor, cap = fit.a_bounds
    if not fit.fixed_a and "A" not in fit.params_at_bounds:
        shown = f"A's interval [{a_low:.3f}, {a_high:.3f}]"
        if a_high >= cap - A_BOUND_TOLERANCE:
            shortfalls.append(
                Shortfall("a_at_cap", f"{shown} reaches the cap {cap:.3f}: run longer, until the curve bends")
            )
        if a_low <= floor + A_BOUND_TOLERANCE:
            # The floor sits a hair above R0 (A = R0 has no curve): name R0 by its own value.
            what = f"R0 {fit.r0:.3f}" if math.isclose(floor, fit.r0, abs_tol=1e-6) else f"its floor a_min {floor:.3f}"
            shortfalls.append(
                Shortfall("a_at_floor", f"{shown} reaches {what}: run longer, until it rises clear of it")
            )
    c_low, c_high = intervals.c_mid
    spread = c_high / c_low
    if spread > MAX_C_MID_SPREAD:
        # One decimal near the limit, so that a spread just over it never reads as the limit itself.
        times = f"{spread:.0f}x" if spread >= 2 * MAX_C_MID_SPREAD else f"{spread:.1f}x"
        shortfalls.append(
            Shortfall(
                "c_mid_spread",
                f"C_mid's interval [{c_low:.4g}, {c_high:.4g}] spans {times} (at most {MAX_C_MID_SPREAD:g}x): "
                "more points past the midpoint",
            )
        )
    return Determination(tuple(shortfalls))


@dataclass(frozen=True)
class Recommendation:
    """What to do with a run at its planned budget, and why."""

    action: Action
    reason: str
    gain_left: float | None
    """Upper end of the interval of the pass rate still to gain by the budget; None when the fit is not
    determined (no gain is read off an interval that reaches a bound)."""


def recommend(
    fit: CurveFit,
    intervals: Intervals,
    current_compute: float,
    planned_compute: float | None = None,
    margin: float = MARGIN,
    rival_asymptotes: Mapping[str, float] | None = None,
) -> Recommendation:
    """Continue, stop or compare, at the planned compute budget.

    - A fit that is not determined (``determination``: too few points, a
      parameter on its bound, A's interval reaching the cap or R0, C_mid's
      too wide):
      continue, saying why and what would determine it. No gain is
      computed: the end of its interval is the search range's, not the
      data's.
    - Another recipe's A within ``margin`` of this one (``rival_asymptotes``,
      by name): compare (``decide`` says whether the data tell them apart).
    - The gain left, from the fitted pass rate at ``current_compute`` to the
      upper end of the projection's interval at ``planned_compute`` (the
      asymptote's interval when no budget is given), within ``margin``:
      stop. Taking the upper end means a run is stopped only when even an
      optimistic reading of the fit leaves nothing worth the compute.
    - Otherwise continue.
    """
    if not (math.isfinite(current_compute) and current_compute > 0):
        raise ValueError(f"current_compute must be a finite compute > 0, got {current_compute}")
    if planned_compute is not None and not (math.isfinite(planned_compute) and planned_compute > 0):
        raise ValueError(f"planned_compute must be a finite compute > 0 or None, got {planned_compute}")
    judged = determination(fit, intervals)
    if not judged.determined:
        return Recommendation("continue", f"not yet determined: {judged.why_not}", None)
    close = sorted(name for name, a in (rival_asymptotes or {}).items() if abs(a - fit.a) <= margin)
    now = float(fit.predict(current_compute))
    if planned_compute is None:
        where, high = "the asymptote", intervals.a.high
    elif planned_compute <= current_compute:
        return Recommendation("stop", f"the planned budget {planned_compute:.4g} is spent", 0.0)
    else:
        where, high = f"the budget {planned_compute:.4g}", float(intervals.band(planned_compute)[1])
    gain_left = max(high - now, 0.0)
    if close:
        return Recommendation(
            "compare",
            f"A {fit.a:.3f} is within {margin} of {', '.join(close)}: compare them (asymptote fit with both runs)",
            gain_left,
        )
    if gain_left <= margin:
        return Recommendation(
            "stop", f"the gain left to {where} is at most {gain_left:.3f}, within the margin {margin}", gain_left
        )
    return Recommendation("continue", f"up to {gain_left:.3f} left to gain by {where}", gain_left)


Outcome = Literal["a_higher", "b_higher", "equivalent", "undecided"]
"""What two runs' fits decide: the first run ("a") higher, the second ("b") higher, the two within the margin
of each other, or none of these at the stated error rate."""
DecidedBy = Literal["asymptote", "pass_rate", "determination"]
"""What settled an outcome: the asymptotes' difference, the difference of the pass rates projected at the target
compute, or (always "undecided") a fit that is not determined."""
ALPHA = 0.05
"""The comparison's error rate: two runs of one recipe come out "a_higher" or "b_higher" at most this often."""


@dataclass(frozen=True)
class Decision:
    """The outcome of comparing run "a" with run "b" (``decide``), with the interval that settled it."""

    outcome: Outcome
    decided_by: DecidedBy
    difference: float | None
    """a minus b of the quantity that settled it (A, or the pass rate at ``target_compute``); None when a fit is
    not determined."""
    interval: Interval | None
    """That difference's ``1 - alpha`` interval; None when a fit is not determined."""
    a_difference: Interval | None
    """A's difference's interval (a minus b), whatever settled it; None when a fit is not determined."""
    target_compute: float
    margin: float
    alpha: float
    reason: str
    """One line: what was compared, its difference with its interval, and how that stands to the margin."""

    @property
    def decided(self) -> bool:
        """One run is placed above the other."""
        return self.outcome in ("a_higher", "b_higher")


def _difference(
    first: npt.NDArray[np.float64], second: npt.NDArray[np.float64], level: float, paired: bool, spread: float
) -> Interval:
    """The ``level`` interval of first - second from two bootstraps' samples.

    Unpaired, over every pair of their samples: independent runs, so any draw of one goes with any draw of
    the other. Paired, sample by sample: the two bootstraps drew the same resamples (the same held-out
    prompts), so the noise they share cancels in each difference. ``spread`` is the standard deviation of a
    noise neither bootstrap sees (the seed-to-seed spread): the interval is then the percentiles of the
    bootstrap difference plus an independent normal of that spread, solved exactly, not drawn.
    """
    if paired:
        if first.shape != second.shape:
            raise ValueError(f"paired samples must line up one to one, got {first.size} and {second.size}")
        difference = first - second
    else:
        difference = np.subtract.outer(first, second).ravel()
    levels = ((1 - level) / 2, (1 + level) / 2)
    if spread <= 0.0:
        low, high = np.quantile(difference, levels)
        return Interval(float(low), float(high))

    def quantile(p: float) -> float:
        # The mixture's distribution function mean(Phi((x - d) / spread)) rises from 0 to 1 across this bracket.
        lo, hi = float(difference.min()) - 10.0 * spread, float(difference.max()) + 10.0 * spread
        return float(brentq(lambda x: float(ndtr((x - difference) / spread).mean()) - p, lo, hi, xtol=1e-7))

    return Interval(quantile(levels[0]), quantile(levels[1]))


def _percent(level: float) -> str:
    """A level for a reader: 95% as "95%", a Bonferroni-split 99.88% as "99.9%"."""
    return f"{100 * level:.3g}%"


def _signed(interval: Interval) -> str:
    return f"[{interval.low:+.3f}, {interval.high:+.3f}]"


def decide(
    first: tuple[CurveFit, Intervals],
    second: tuple[CurveFit, Intervals],
    target_compute: float,
    margin: float = MARGIN,
    alpha: float = ALPHA,
    compute_unit: ComputeUnit = "flops",
    *,
    paired: bool = False,
    spread: float = 0.0,
) -> Decision:
    """Compare run "a" (``first``: its fit and bootstrap intervals) with run "b" (``second``): the one rule
    ``asymptote fit``, the live fitter and a sweep share.

    ScaleRL (arXiv 2510.13786, section 5) orders recipes by A and, for asymptotes within the margin (0.02, the
    run-to-run spread of A it measured), by efficiency; here each step is taken only where the data decide it:

    1. Both fits must be determined (``determination``); otherwise "undecided", saying which is not.
    2. The ``1 - alpha`` interval of A_a - A_b (over every pair of the two bootstraps' samples) lies beyond
       the margin: the run with the higher A is higher, by its asymptote.
    3. Otherwise (A's difference is not shown beyond the margin) the pass rates projected at
       ``target_compute`` are compared the same way: their difference's interval beyond the margin places
       one run higher; inside ``[-margin, margin]``, "equivalent"; neither, "undecided".

    The projected rate is the efficiency comparison in the margin's own unit (a difference of B has no
    margin to be equivalent within); at the compute both runs reached it is an interpolation of their fits.
    Decisions need an interval beyond the margin, not merely clear of 0: the bootstrap covers the eval
    rounds' noise, the margin the seed-to-seed spread it does not see. Simulated pairs of one curve (200
    prompts x 4 samples a round, 31 rounds) came out decided in 4 of 200 pairs (the rule it replaces, B's
    point estimate within the margin: 125), and pairs 0.06 apart in A decided the right way in 187 of 200,
    never the wrong way (``tests/fitter/test_fitter_compare.py``).

    ``paired``: the two intervals' samples come from the same resamples (``curve.resampled_intervals`` over
    the same held-out prompt draws), so differences are taken sample by sample. ``spread``: the standard
    deviation of the difference that neither bootstrap sees (seed-to-seed), added to both differences'
    intervals. ``asymptote fit`` takes neither (independent runs, the margin standing for the seeds); a sweep
    (``services/sweep/rule.py``) takes both.
    """
    if not (0.0 < alpha < 1.0):
        raise ValueError(f"alpha must be an error rate in (0, 1), got {alpha}")
    if not (math.isfinite(target_compute) and target_compute > 0):
        raise ValueError(f"target_compute must be a finite compute > 0, got {target_compute}")
    if not (math.isfinite(spread) and spread >= 0.0):
        raise ValueError(f"spread must be a finite standard deviation >= 0, got {spread}")
    level = 1.0 - alpha
    shortfalls = [
        f"{name} not determined: {judged.why_not}"
        for name, judged in (("a", determination(*first)), ("b", determination(*second)))
        if not judged.determined
    ]
    if shortfalls:
        reason = "; ".join(shortfalls)
        return Decision("undecided", "determination", None, None, None, target_compute, margin, alpha, reason)
    (fit_a, iv_a), (fit_b, iv_b) = first, second
    a_diff = _difference(iv_a.a_samples, iv_b.a_samples, level, paired, spread)
    a_said = f"A {fit_a.a - fit_b.a:+.3f} {_signed(a_diff)}"
    if a_diff.low > margin or a_diff.high < -margin:
        outcome: Outcome = "a_higher" if a_diff.low > margin else "b_higher"
        reason = f"{a_said} at {_percent(level)}, beyond the margin {margin:g}"
        return Decision(outcome, "asymptote", fit_a.a - fit_b.a, a_diff, a_diff, target_compute, margin, alpha, reason)

    def at_target(fit: CurveFit, iv: Intervals) -> npt.NDArray[np.float64]:
        return predict(target_compute, iv.a_samples, iv.b_samples, iv.c_mid_samples, fit.r0)

    rate_diff = _difference(at_target(fit_a, iv_a), at_target(fit_b, iv_b), level, paired, spread)
    difference = float(fit_a.predict(target_compute) - fit_b.predict(target_compute))
    said = f"pass rate at {compute_text(target_compute, compute_unit)} {difference:+.3f} {_signed(rate_diff)} at {_percent(level)}"
    if rate_diff.low > margin or rate_diff.high < -margin:
        outcome = "a_higher" if rate_diff.low > margin else "b_higher"
        reason = f"{said}, beyond the margin {margin:g} ({a_said} is not)"
    elif -margin <= rate_diff.low and rate_diff.high <= margin:
        outcome, reason = "equivalent", f"{said}, within the margin {margin:g} ({a_said})"
    else:
        outcome = "undecided"
        reason = f"{said}: neither within the margin {margin:g} nor beyond it ({a_said}); run longer or evaluate more"
    return Decision(outcome, "pass_rate", difference, rate_diff, a_diff, target_compute, margin, alpha, reason)


@dataclass(frozen=True)
class RunComparison:
    """One row of a recipe comparison: determined runs by rank, then the runs that are not, unranked."""

    rank: int | None
    """1 + the number of runs decided above this one; runs not ordered against each other can share one. None:
    the fit is not determined, so it is not ranked."""
    name: str
    determined: bool
    why_not_determined: str
    a: float
    a_interval: Interval
    b: float
    b_interval: Interval
    c_mid: float
    r0: float
    rmse: float
    num_points_used: int
    identifiable: bool
    """No parameter at the bound of its search range."""
    params_at_bounds: tuple[str, ...]
    target_compute: float
    """Where the pass rates were compared: the budget, else the compute every run reached."""
    pass_rate_at_target: float
    pass_rate_interval: Interval
    decisions: dict[str, Decision]
    """This run ("a") against each other run ("b"), by the other's name."""
    verdict: str
    """One line on where this run stands, e.g. "below hi (A ...)", "equivalent to x (...)", "not ranked: ..."."""


RunData = tuple[npt.ArrayLike, npt.ArrayLike, float]


@dataclass(frozen=True)
class _Fitted:
    fit: CurveFit
    intervals: Intervals
    compute_max: float


def _fit(name: str, data: RunData, settings: CurveFitSettings, targets: Sequence[float] = ()) -> _Fitted:
    compute = np.asarray(data[0], dtype=np.float64)
    pass_rate = np.asarray(data[1], dtype=np.float64)
    try:
        fit = fit_curve(compute, pass_rate, data[2], settings)
        intervals = bootstrap_intervals(compute, pass_rate, data[2], settings, fit, targets)
    except FitError as error:
        raise FitError(f"run {name!r}: {error}") from error
    return _Fitted(fit, intervals, float(compute.max()))


_RELATION = {"a_higher": "above", "b_higher": "below", "equivalent": "equivalent to", "undecided": "undecided against"}


def compare_runs(
    runs: Mapping[str, RunData],
    settings: CurveFitSettings | None = None,
    margin: float = MARGIN,
    alpha: float = ALPHA,
    target_compute: float | None = None,
    compute_unit: ComputeUnit = "flops",
) -> list[RunComparison]:
    """Compare every pair of runs with ``decide`` and rank the determined ones by what was decided.

    ``runs`` maps a name to (compute, pass_rate, r0). The pass rates are compared at ``target_compute`` (the
    budget), else at the largest compute every run reached. A run's rank is 1 plus the number of runs decided
    above it; a run whose fit is not determined is never ranked (it comes last, saying why). Raises FitError
    naming the run that could not be fitted.
    """
    settings = settings or CurveFitSettings()
    fitted = {name: _fit(name, data, settings) for name, data in runs.items()}
    target = (
        target_compute if target_compute is not None else min((f.compute_max for f in fitted.values()), default=1.0)
    )
    pairs = {
        (a, b): decide(
            (fitted[a].fit, fitted[a].intervals),
            (fitted[b].fit, fitted[b].intervals),
            target,
            margin,
            alpha,
            compute_unit,
        )
        for a in fitted
        for b in fitted
        if a != b
    }
    judged = {name: determination(f.fit, f.intervals) for name, f in fitted.items()}
    rows = []
    for name, run in fitted.items():
        decisions = {b: pairs[(a, b)] for a, b in pairs if a == name}
        level = 1.0 - alpha
        at_target = predict(
            target, run.intervals.a_samples, run.intervals.b_samples, run.intervals.c_mid_samples, run.fit.r0
        )
        low, high = np.quantile(at_target, [(1 - level) / 2, (1 + level) / 2])
        if judged[name].determined:
            rank: int | None = 1 + sum(d.outcome == "b_higher" for d in decisions.values())
            verdict = (
                "; ".join(
                    f"{_RELATION[d.outcome]} {other}"
                    + (f" ({d.reason})" if d.decided_by != "determination" else " (not determined)")
                    for other, d in decisions.items()
                )
                or "the only run"
            )
        else:
            rank, verdict = None, f"not ranked: not determined: {judged[name].why_not}"
        fit = run.fit
        rows.append(
            RunComparison(
                rank=rank,
                name=name,
                determined=judged[name].determined,
                why_not_determined=judged[name].why_not,
                a=fit.a,
                a_interval=run.intervals.a,
                b=fit.b,
                b_interval=run.intervals.b,
                c_mid=fit.c_mid,
                r0=fit.r0,
                rmse=fit.rmse,
                num_points_used=fit.num_points_used,
                identifiable=fit.identifiable,
                params_at_bounds=fit.params_at_bounds,
                target_compute=target,
                pass_rate_at_target=float(fit.predict(target)),
                pass_rate_interval=Interval(float(low), float(high)),
                decisions=decisions,
                verdict=verdict,
            )
        )
    return sorted(rows, key=lambda r: (r.rank is None, r.rank or 0, -r.pass_rate_at_target))


def summary_line(rows: Sequence[RunComparison]) -> str:
    """The comparison's answer in one line: "decided: x > y", "equivalent: x = y", or "undecided" with why."""
    if not rows:
        return "no runs to compare"
    ranked = [row for row in rows if row.rank is not None]
    unranked = [row.name for row in rows if row.rank is None]
    pairs = [
        (row, other, d)
        for i, row in enumerate(ranked)
        for other, d in row.decisions.items()
        if other in {r.name for r in ranked[i + 1 :]}
    ]
    if len(rows) == 2:
        row, other, d = rows[0], rows[1].name, rows[0].decisions[rows[1].name]
        if d.outcome == "equivalent":
            return f"equivalent: {row.name} = {other} ({d.reason})"
        if d.decided:
            high, low = (row.name, other) if d.outcome == "a_higher" else (other, row.name)
            return f"decided: {high} > {low} ({d.reason})"
        return f"undecided: {row.name} vs {other} ({d.reason})"
    if not unranked and pairs and all(d.decided for _, _, d in pairs):
        return "decided: " + " > ".join(row.name for row in ranked)
    if not unranked and pairs and all(d.outcome == "equivalent" for _, _, d in pairs):
        return "equivalent: " + " = ".join(row.name for row in ranked) + f" within the margin {pairs[0][2].margin:g}"
    parts = [
        f"{row.name} {'>' if d.outcome == 'a_higher' else '<' if d.outcome == 'b_higher' else '=' if d.outcome == 'equivalent' else '?'} {other}"
        for row, other, d in pairs
    ]
    if unranked:
        parts.append(f"not determined: {', '.join(unranked)}")
    return f"undecided: {'; '.join(parts) or 'fewer than two determined fits'}"
