"""What a fit lets one decide: continue, stop or compare a run; rank recipes or not.

Owns the decisions of docs/recipe.md, "The compute-performance curve", built on ``curve.py``'s fits and
bootstrap intervals (ScaleRL, arXiv 2510.13786): whether a fit is
determined (``determination``: the one rule every reader of a fit uses), a
run's recommendation at its planned compute budget, and the recipe
comparison, which ranks only fits the data pin down and answers
"undecided: run longer" when the intervals do not order two runs. Knows
nothing about files, NATS or Prometheus. Torch-free.

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

from services.fitter.curve import (
    CurveFit,
    CurveFitSettings,
    FitError,
    Interval,
    Intervals,
    bootstrap_intervals,
    fit_curve,
)

MARGIN = 0.02
"""The paper's run-to-run spread of A (pass rate): differences within it are noise."""
COMPUTE_MULTIPLES = (1.5, 2.0, 3.0, 5.0, 10.0)
"""Longer runs tried, as multiples of a run's compute, when estimating what would decide a comparison."""
# Points added to a simulated longer run at most, so an estimate stays cheap.
_MAX_EXTRA_POINTS = 400

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


def _at_bound_reason(fit: CurveFit) -> str:
    names = ", ".join(fit.params_at_bounds)
    return f"not yet identifiable: {names} at the bound of the search range; run longer before projecting"


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
      by name): compare (refit both with a shared A and compare B).
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
            f"A {fit.a:.3f} is within {margin} of {', '.join(close)}: refit with a shared A and compare B",
            gain_left,
        )
    if gain_left <= margin:
        return Recommendation(
            "stop", f"the gain left to {where} is at most {gain_left:.3f}, within the margin {margin}", gain_left
        )
    return Recommendation("continue", f"up to {gain_left:.3f} left to gain by {where}", gain_left)


@dataclass(frozen=True)
class RunComparison:
    """One row of a recipe comparison, best first; runs not yet identifiable come last, unranked."""

    rank: int | None
    """Place in the order; runs the intervals cannot order share one; None when not identifiable."""
    name: str
    a: float
    a_interval: Interval
    b: float
    c_mid: float
    r0: float
    rmse: float
    num_points_used: int
    identifiable: bool
    """No parameter at the bound of its search range."""
    params_at_bounds: tuple[str, ...]
    tie_group: int | None
    """Runs sharing a group have asymptotes within the margin of each other."""
    shared_a: float | None
    """Mean A of the group the run was refitted with, if it was tied."""
    b_at_shared_a: float | None
    """B refitted with A fixed at ``shared_a``; decides the order within a group."""
    c_mid_at_shared_a: float | None
    decided_by: Literal["asymptote", "efficiency", "undecided"]
    verdict: str
    """One line on what placed this run, e.g. "undecided: run longer ..."."""
    compute_multiple_to_decide: float | None = None
    """For an undecided run: the multiple of the runs' compute at which a longer run would decide, if estimated."""


RunData = tuple[npt.ArrayLike, npt.ArrayLike, float]


@dataclass(frozen=True)
class _Fitted:
    compute: npt.NDArray[np.float64]
    pass_rate: npt.NDArray[np.float64]
    r0: float
    fit: CurveFit
    intervals: Intervals


def _fit(name: str, data: RunData, settings: CurveFitSettings) -> _Fitted:
    compute = np.asarray(data[0], dtype=np.float64)
    pass_rate = np.asarray(data[1], dtype=np.float64)
    try:
        fit = fit_curve(compute, pass_rate, data[2], settings)
        intervals = bootstrap_intervals(compute, pass_rate, data[2], settings, fit)
    except FitError as error:
        raise FitError(f"run {name!r}: {error}") from error
    return _Fitted(compute, pass_rate, data[2], fit, intervals)


def extended_run(
    compute: npt.NDArray[np.float64], pass_rate: npt.NDArray[np.float64], fit: CurveFit, multiple: float
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """The run continued to ``multiple`` x its compute, as its fit expects it to go.

    New points keep the run's mean spacing of evaluations (at most
    ``_MAX_EXTRA_POINTS``), at the fitted curve plus the run's own residuals
    taken in turn, so the longer run is as noisy as this one: no random draw.
    """
    c, y = compute, pass_rate
    last = float(c.max())
    spacing = max((last - float(c.min())) / max(c.size - 1, 1), last * 1e-3)
    num_extra = min(max(1, math.ceil((multiple - 1.0) * last / spacing)), _MAX_EXTRA_POINTS)
    extra = np.linspace(last, multiple * last, num_extra + 1)[1:]
    residual = y - fit.predict(c)
    noise = residual[np.arange(num_extra) % residual.size]
    return np.concatenate([c, extra]), np.clip(np.concatenate([y, fit.predict(extra) + noise]), 0.0, 1.0)


def _separated(upper: _Fitted, lower: _Fitted, margin: float) -> bool:
    """Whether the asymptotes order the two: both identifiable, and A within the margin
    (the shared-A comparison decides) or the A intervals apart."""
    if not (upper.fit.identifiable and lower.fit.identifiable):
        return False
    hi, lo = (upper, lower) if upper.fit.a >= lower.fit.a else (lower, upper)
    return hi.fit.a - lo.fit.a <= margin or lo.intervals.a.high < hi.intervals.a.low


def compute_multiple_to_decide(
    upper: _Fitted, lower: _Fitted, settings: CurveFitSettings, margin: float
) -> float | None:
    """The smallest of ``COMPUTE_MULTIPLES`` at which both runs, continued as
    their fits expect, would be ordered; None when none would or a fit is
    not identifiable (its expectation is not to be trusted)."""
    if not (upper.fit.identifiable and lower.fit.identifiable):
        return None
    for multiple in COMPUTE_MULTIPLES:
        longer = []
        for run in (upper, lower):
            compute, pass_rate = extended_run(run.compute, run.pass_rate, run.fit, multiple)
            try:
                longer.append(_fit("simulated", (compute, pass_rate, run.r0), settings))
            except FitError:
                return None
        if _separated(longer[0], longer[1], margin):
            return multiple
    return None


def _undecided_verdict(other: str, multiple: float | None, why: str) -> str:
    if multiple is None:
        return f"undecided: run longer ({why}; no estimate of how much longer up to {COMPUTE_MULTIPLES[-1]:g}x)"
    return f"undecided: run longer ({why}; about {multiple:g}x the compute would decide against {other})"


def compare_runs(
    runs: Mapping[str, RunData],
    settings: CurveFitSettings | None = None,
    margin: float = MARGIN,
    estimate: bool = True,
) -> list[RunComparison]:
    """Rank runs by fitted asymptote A where the fits and their intervals allow it.

    The paper's procedure on identifiable fits: runs whose asymptotes lie
    within ``margin`` are refitted with A fixed at the group's mean and
    ordered by B (higher B reaches the shared asymptote with less compute).
    Groups are formed greedily down the A ranking. A run whose A interval
    overlaps the group above it is not ordered against it: it shares that
    group's rank, decided by "undecided". A run with a parameter at its
    bound is not ranked at all. Undecided runs say, with ``estimate``, how
    many times their compute would decide (``compute_multiple_to_decide``).
    ``runs`` maps a name to (compute, pass_rate, r0). Raises FitError naming
    the run that failed.
    """
    settings = settings or CurveFitSettings()
    fitted = {name: _fit(name, data, settings) for name, data in runs.items()}
    ordered = sorted((n for n in fitted if fitted[n].fit.identifiable), key=lambda n: -fitted[n].fit.a)
    groups: list[list[str]] = []
    for name in ordered:
        if groups and fitted[groups[-1][0]].fit.a - fitted[name].fit.a <= margin + 1e-12:
            groups[-1].append(name)
        else:
            groups.append([name])

    rows: list[RunComparison] = []
    rank = 0
    for group_index, group in enumerate(groups):
        refits: dict[str, CurveFit] = {}
        shared_a: float | None = None
        if len(group) > 1:
            shared_a = float(np.mean([fitted[name].fit.a for name in group]))
            for name in group:
                compute, pass_rate, r0 = runs[name]
                try:
                    refits[name] = fit_curve(compute, pass_rate, r0, settings, fixed_a=shared_a)
                except FitError as error:
                    raise FitError(f"run {name!r} at shared A {shared_a:.4f}: {error}") from error
            group = sorted(group, key=lambda name: -refits[name].b)
        # The group above is ordered against this one only if every A interval there
        # lies above every A interval here.
        above = groups[group_index - 1] if group_index else []
        overlapping = [
            other
            for other in above
            if any(fitted[name].intervals.a.high >= fitted[other].intervals.a.low for name in group)
        ]
        undecided = bool(overlapping)
        multiple = None
        if undecided and estimate:
            rival = fitted[overlapping[0]]
            multiple = compute_multiple_to_decide(rival, fitted[group[0]], settings, margin)
        for name in group:
            run = fitted[name]
            refit = refits.get(name)
            if undecided:
                decided_by: Literal["asymptote", "efficiency", "undecided"] = "undecided"
                verdict = _undecided_verdict(
                    overlapping[0], multiple, f"A intervals overlap with {', '.join(overlapping)}"
                )
            else:
                rank = len(rows) + 1
                if refit is not None:
                    decided_by = "efficiency"
                    verdict = f"A within {margin} of its group: B {refit.b:.2f} at the shared A {shared_a:.3f}"
                else:
                    decided_by = "asymptote"
                    verdict = "highest A" if not rows else f"A interval below {', '.join(above)}'s"
            rows.append(_row(name, run, rank, group_index + 1, shared_a, refit, decided_by, verdict, multiple))
    for name, run in fitted.items():
        if run.fit.identifiable:
            continue
        verdict = f"undecided: run longer ({_at_bound_reason(run.fit)})"
        rows.append(_row(name, run, None, None, None, None, "undecided", verdict, None))
    return rows


def _row(
    name: str,
    run: _Fitted,
    rank: int | None,
    tie_group: int | None,
    shared_a: float | None,
    refit: CurveFit | None,
    decided_by: Literal["asymptote", "efficiency", "undecided"],
    verdict: str,
    multiple: float | None,
) -> RunComparison:
    fit = run.fit
    return RunComparison(
        rank=rank,
        name=name,
        a=fit.a,
        a_interval=run.intervals.a,
        b=fit.b,
        c_mid=fit.c_mid,
        r0=fit.r0,
        rmse=fit.rmse,
        num_points_used=fit.num_points_used,
        identifiable=fit.identifiable,
        params_at_bounds=fit.params_at_bounds,
        tie_group=tie_group,
        shared_a=shared_a,
        b_at_shared_a=refit.b if refit else None,
        c_mid_at_shared_a=refit.c_mid if refit else None,
        decided_by=decided_by,
        verdict=verdict,
        compute_multiple_to_decide=multiple,
    )


def summary_line(rows: Sequence[RunComparison]) -> str:
    """The comparison's answer in one line: the order it can state, or "undecided: run longer"."""
    if not rows:
        return "no runs to compare"
    undecided = [row for row in rows if row.decided_by == "undecided"]
    if not undecided:
        return "decided: " + " > ".join(row.name for row in rows)
    estimates = [row.compute_multiple_to_decide for row in undecided if row.compute_multiple_to_decide is not None]
    how_long = f"; about {max(estimates):g}x the compute would decide" if estimates else ""
    return f"undecided: run longer ({', '.join(row.name for row in undecided)} not ordered{how_long})"
