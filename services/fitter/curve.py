"""The sigmoid compute-performance curve: fit and uncertainty.

Owns the maths of docs/recipe.md, "The compute-performance curve" (ScaleRL, Khatri, Madaan et al. 2025,
arXiv 2510.13786, Eq. 1 and Appendix on fitting):

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)

with ``A`` the asymptotic pass rate, ``B > 0`` the efficiency exponent,
``C_mid`` the compute at which half of the gain ``A - R0`` is reached and
``R0`` the pass rate before RL, held fixed. Writing ``u = ln C`` and
``m = ln C_mid`` the curve is ``R0 + (A - R0) * expit(B * (u - m))``, a
logistic in log-compute; every evaluation here uses that form because it
neither overflows for tiny C nor loses precision for huge C.

Knows nothing about files, NATS, Prometheus or plotting: inputs are arrays of
cumulative compute (accelerator-seconds as the services measure it, or any
positive unit used consistently) and pass rates in [0, 1]; outputs are frozen results. The
array kernels (grid statistics, batched Levenberg-Marquardt) are in
``kernels.py``; what a fit lets one decide is ``decision.py``. Torch-free.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator
from scipy.optimize import least_squares
from scipy.special import expit

from asymptote.config import Frozen
from asymptote.errors import AsymptoteError
from services.fitter.kernels import FloatArray, polish_batch, residuals_and_jacobian, sigmoid_sums, weighted_sse

log = logging.getLogger(__name__)

ArrayLike = npt.ArrayLike

# B is profiled on a log-spaced grid (then refined by a parabola through the
# three best nodes): 80 nodes over the default [0.1, 10] are 6% apart, close
# enough that the parabola lands within the final polish's basin.
_NUM_B_GRID = 80
# The bootstrap locates each resample's basin on a coarser (C_mid, B) grid
# with A profiled out in closed form, then polishes all resamples at once
# with a vectorised Levenberg-Marquardt; the coarse grid only has to find the
# right basin, the polish supplies the precision.
_BOOT_NUM_C_MID = 32
_BOOT_NUM_B = 32
# Parameters count as "at a bound" within this relative distance of it.
_BOUND_RTOL = 1e-6


class FitError(AsymptoteError, ValueError):
    """The data cannot support a curve fit; the message names the reason."""


class TooFewPointsError(FitError):
    """A run too young to fit: fewer eval points than the fit needs (a longer run will have them)."""


class CurveFitSettings(Frozen):
    """How the curve is fitted and how its uncertainty is estimated."""

    a_min: float | None = Field(default=None, ge=0.0, lt=1.0)
    """Lowest asymptote A on the grid (pass rate); None starts one step above R0."""
    a_max: float = Field(default=1.0, gt=0.0, le=1.0)
    """Highest asymptote A on the grid (pass rate); the paper used 0.800."""
    a_step: float = Field(default=0.005, gt=0.0, le=0.1)
    """Spacing of the A grid (pass rate); the paper used 0.005."""
    num_c_mid: int = Field(default=100, ge=2, le=10_000)
    """Number of log-spaced C_mid values on the grid; the paper used 100."""
    c_mid_range: tuple[float, float] | None = None
    """C_mid search range in compute units, e.g. the paper's (100, 40000) GPU-hours; None derives it from the data."""
    c_mid_low_multiple: float = Field(default=0.01, gt=0.0)
    """Without c_mid_range: lowest C_mid, as a multiple of the smallest compute used (below the data, as the paper's)."""
    c_mid_high_multiple: float = Field(default=100.0, gt=0.0)
    """Without c_mid_range: highest C_mid, as a multiple of the largest observed compute."""
    b_min: float = Field(default=0.1, gt=0.0)
    """Lower bound on the efficiency exponent B (dimensionless)."""
    b_max: float = Field(default=10.0, gt=0.0)
    """Upper bound on the efficiency exponent B (dimensionless)."""
    early_cutoff: Literal["compute", "relative"] = "compute"
    """Early cutoff kind: a fixed compute (the paper: ~1.5k GPU-hours, about one epoch) or a fraction of the largest."""
    early_cutoff_compute: float = Field(default=0.0, ge=0.0)
    """With early_cutoff "compute": exclude points below this compute (the axis's unit; 1.5k GPU-hours is 5.4e6 s)."""
    early_cutoff_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    """With early_cutoff "relative": exclude points below this fraction of the largest observed compute."""
    min_num_points: int = Field(default=4, ge=3)
    """Fewest points left after the cutoff for a fit (three parameters are free)."""
    num_bootstrap_resamples: int = Field(default=200, ge=2, le=100_000)
    """Bootstrap resamples for the intervals."""
    bootstrap_kind: Literal["residual", "points"] = "residual"
    """Resample residuals around the fit (keeps compute fixed) or whole (compute, pass rate) points."""
    interval_level: float = Field(default=0.95, gt=0.0, lt=1.0)
    """Two-sided coverage of the percentile bootstrap intervals (fraction)."""
    rng_seed: int = 0
    """Seed of the bootstrap's random generator, so intervals are reproducible."""

    @model_validator(mode="after")
    def _check_ranges(self) -> CurveFitSettings:
        if self.a_min is not None and self.a_min >= self.a_max:
            raise ValueError(f"a_min {self.a_min} must be below a_max {self.a_max}")
        if self.b_min >= self.b_max:
            raise ValueError(f"b_min {self.b_min} must be below b_max {self.b_max}")
        if self.c_mid_range is not None:
            low, high = self.c_mid_range
            if not (math.isfinite(low) and math.isfinite(high) and 0.0 < low < high):
                raise ValueError(f"c_mid_range {self.c_mid_range} must be two finite compute values 0 < low < high")
        return self


class Interval(NamedTuple):
    """A two-sided interval ``[low, high]``."""

    low: float
    high: float


@dataclass(frozen=True)
class CurveFit:
    """A fitted curve and how it was obtained."""

    a: float
    """Asymptotic pass rate A."""
    b: float
    """Efficiency exponent B."""
    c_mid: float
    """Compute at which half of the gain A - R0 is reached."""
    r0: float
    """Pass rate before RL, held fixed."""
    sse: float
    """Sum of squared errors over the points used."""
    rmse: float
    """Root-mean-square error over the points used."""
    num_points_used: int
    """Points left after the early cutoff."""
    cutoff_compute: float
    """Points with compute below this were excluded."""
    a_bounds: Interval
    """A's search range: R0 (or ``a_min``) to ``a_max``; the bootstrap's A never leaves it either."""
    fixed_a: bool = False
    """A was held fixed (recipe comparison) rather than fitted."""
    params_at_bounds: tuple[str, ...] = ()
    """Parameters that ended on a bound of their search range: the data do not pin them down."""

    @property
    def identifiable(self) -> bool:
        """No parameter ended on a bound: the data pin the curve down, so its projection means something."""
        return not self.params_at_bounds

    def predict(self, compute: ArrayLike) -> FloatArray:
        """Pass rate predicted at ``compute`` (> 0), same shape as the input."""
        return predict(compute, self.a, self.b, self.c_mid, self.r0)


@dataclass(frozen=True, eq=False)
class Intervals:
    """Bootstrap percentile intervals for the parameters and projections."""

    level: float
    a: Interval
    b: Interval
    c_mid: Interval
    target_compute: tuple[float, ...]
    projection: tuple[Interval, ...]
    """Interval of the projected pass rate at each target compute."""
    r0: float
    a_samples: FloatArray
    b_samples: FloatArray
    c_mid_samples: FloatArray

    def band(self, compute: ArrayLike) -> tuple[FloatArray, FloatArray]:
        """Pointwise (low, high) interval of the curve at ``compute``."""
        c = np.asarray(compute, dtype=np.float64)
        curves = predict(
            c.reshape(1, -1),
            self.a_samples[:, None],
            self.b_samples[:, None],
            self.c_mid_samples[:, None],
            self.r0,
        )
        q = _quantile_levels(self.level)
        low, high = np.quantile(curves, q, axis=0)
        return low.reshape(c.shape), high.reshape(c.shape)


def predict(compute: ArrayLike, a: ArrayLike, b: ArrayLike, c_mid: ArrayLike, r0: ArrayLike) -> FloatArray:
    """``R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)``, broadcasting over all inputs."""
    c = np.asarray(compute, dtype=np.float64)
    a_ = np.asarray(a, dtype=np.float64)
    r0_ = np.asarray(r0, dtype=np.float64)
    z = np.asarray(b, dtype=np.float64) * (np.log(c) - np.log(np.asarray(c_mid, dtype=np.float64)))
    value = r0_ + (a_ - r0_) * expit(z)
    # r0 + (a - r0) can round one ulp past a; clip so the curve provably stays
    # between R0 and A (callers and the property test rely on it).
    clipped: FloatArray = np.clip(value, np.minimum(r0_, a_), np.maximum(r0_, a_))
    return clipped


@dataclass(frozen=True)
class _Problem:
    """Validated points after the cutoff, and the search ranges derived from the data."""

    log_c: FloatArray
    pass_rate: FloatArray
    r0: float
    cutoff_compute: float
    a_grid: FloatArray
    a_bounds: tuple[float, float]
    log_c_mid_bounds: tuple[float, float]
    log_b_bounds: tuple[float, float]


def early_cutoff(compute: FloatArray, settings: CurveFitSettings) -> float:
    """The compute below which points are left out as the early, noisy regime.

    ScaleRL (arXiv 2510.13786, Appendix A.5) excludes a fixed amount of
    compute, about one epoch of prompts (~1.5k GPU-hours): "compute". The
    "relative" cutoff (a fraction of the largest compute so far) moves as the
    run grows, so early points re-enter and leave the fit; it is an option.
    """
    if settings.early_cutoff == "compute":
        return float(settings.early_cutoff_compute)
    return float(settings.early_cutoff_fraction * compute.max())


def _check_points(c: FloatArray, y: FloatArray, r0: float) -> None:
    """Refuse values no run can produce, naming the first offending element."""
    for name, values in (("compute", c), ("pass_rate", y)):
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise FitError(f"non-finite value: {name}[{bad[0]}] is {values[bad[0]]}; values must be finite numbers")
    if not math.isfinite(r0):
        raise FitError(f"non-finite value: r0 is {r0}; it must be the finite step-0 pass rate")
    bad = np.flatnonzero(c <= 0)
    if bad.size:
        raise FitError(f"compute must be > 0: compute[{bad[0]}] is {c[bad[0]]:g}")
    bad = np.flatnonzero(np.diff(c) < 0)
    if bad.size:
        i = int(bad[0]) + 1
        raise FitError(
            f"compute must not decrease along the run: compute[{i}] = {c[i]:g} follows "
            f"compute[{i - 1}] = {c[i - 1]:g} (points are a run's evaluations in order, compute cumulative)"
        )
    bad = np.flatnonzero((y < 0) | (y > 1))
    if bad.size:
        raise FitError(f"pass rates must lie in [0, 1]: pass_rate[{bad[0]}] = {y[bad[0]]:g} is outside [0, 1]")
    if not 0.0 <= r0 <= 1.0:
        raise FitError(f"r0 (the step-0 pass rate) = {r0:g} is outside [0, 1]")


def _prepare(
    compute: ArrayLike,
    pass_rate: ArrayLike,
    r0: float,
    settings: CurveFitSettings,
    fixed_a: float | None,
) -> _Problem:
    c = np.asarray(compute, dtype=np.float64)
    y = np.asarray(pass_rate, dtype=np.float64)
    if c.ndim != 1 or y.ndim != 1 or c.shape != y.shape:
        raise FitError(f"compute and pass_rate must be 1-D arrays of equal length, got shapes {c.shape} and {y.shape}")
    if c.size == 0:
        raise TooFewPointsError("too few points: no points given")
    _check_points(c, y, r0)

    cutoff = early_cutoff(c, settings)
    used = c >= cutoff
    num_used = int(used.sum())
    if num_used < settings.min_num_points:
        raise TooFewPointsError(
            f"too few points after the early cutoff at compute {cutoff:g}: "
            f"{num_used} left, at least {settings.min_num_points} needed"
        )
    c_used, y_used = c[used], y[used]
    if np.ptp(c_used) == 0:
        raise FitError(f"all compute values equal ({c_used[0]:g}) after the cutoff: B and C_mid are undefined")
    if np.ptp(y_used) == 0:
        raise FitError(f"all pass rates equal ({y_used[0]:g}) after the cutoff: no curve to fit")
    if y_used.mean() <= r0:
        raise FitError(f"no gain over R0: mean pass rate after the cutoff {y_used.mean():.4f} <= R0 {r0:.4f}")

    if fixed_a is not None:
        if not r0 < fixed_a <= 1.0:
            raise FitError(f"fixed A {fixed_a} must lie in (R0, 1] = ({r0}, 1]")
        a_grid = np.array([fixed_a])
        a_bounds = (fixed_a, fixed_a)
    else:
        step = settings.a_step
        low = r0 if settings.a_min is None else max(r0, settings.a_min)
        # Grid values sit on multiples of the step (0.450, 0.455, ...) as in the
        # paper, strictly above R0 because A = R0 is a flat line with no B.
        k_low = math.floor(low / step + 1e-9) + 1 if low == r0 else math.ceil(low / step - 1e-9)
        k_high = math.floor(settings.a_max / step + 1e-9)
        if k_high < k_low:
            raise FitError(f"no gain over R0: R0 {r0} leaves no A on the grid up to a_max {settings.a_max}")
        a_grid = np.round(np.arange(k_low, k_high + 1) * step, 12)
        a_bounds = (max(low, r0 + 1e-9), settings.a_max)

    if settings.c_mid_range is not None:
        c_mid_low, c_mid_high = settings.c_mid_range
    else:
        c_mid_low = settings.c_mid_low_multiple * float(c_used.min())
        c_mid_high = settings.c_mid_high_multiple * float(c.max())
    if c_mid_high <= c_mid_low:
        raise FitError(f"empty C_mid range [{c_mid_low:g}, {c_mid_high:g}]; check the c_mid multiples")
    return _Problem(
        log_c=np.log(c_used),
        pass_rate=y_used,
        r0=float(r0),
        cutoff_compute=cutoff,
        a_grid=a_grid,
        a_bounds=a_bounds,
        log_c_mid_bounds=(math.log(c_mid_low), math.log(c_mid_high)),
        log_b_bounds=(math.log(settings.b_min), math.log(settings.b_max)),
    )


def _fit_problem(problem: _Problem, settings: CurveFitSettings, fixed: bool) -> CurveFit:
    """Grid over (A, C_mid), B profiled at each node, then a continuous polish."""
    log_c, y, r0 = problem.log_c, problem.pass_rate, problem.r0
    log_c_mid = np.linspace(*problem.log_c_mid_bounds, settings.num_c_mid)
    log_b = np.linspace(*problem.log_b_bounds, _NUM_B_GRID)
    gain = (y - r0)[None, :]
    s1, s2 = sigmoid_sums(log_c, log_c_mid, log_b, gain, np.ones_like(gain))
    a = (problem.a_grid - r0)[:, None, None]
    sse = float((gain**2).sum()) - 2.0 * a * s1[0][None] + a * a * s2[0][None]  # (nA, nM, nB)

    # Profile B at each (A, C_mid): best node, then the vertex of the parabola
    # through it and its neighbours (in log B), where the best is interior.
    k = np.clip(sse.argmin(axis=-1), 1, log_b.size - 2)
    f_left = np.take_along_axis(sse, (k - 1)[..., None], -1)[..., 0]
    f_mid = np.take_along_axis(sse, k[..., None], -1)[..., 0]
    f_right = np.take_along_axis(sse, (k + 1)[..., None], -1)[..., 0]
    curvature = f_left - 2.0 * f_mid + f_right
    convex = curvature > 0
    # Offset in grid steps from node k: the parabola's vertex where it is
    # convex (kept within the bracket), else the best of the three nodes.
    node_offset = np.stack([f_left, f_mid, f_right]).argmin(axis=0) - 1.0
    vertex_offset = np.clip(0.5 * (f_left - f_right) / np.where(convex, curvature, 1.0), -1.0, 1.0)
    offset = np.where(convex, vertex_offset, node_offset)
    profiled = np.where(
        convex,
        f_mid + 0.5 * (f_right - f_left) * offset + 0.5 * curvature * offset**2,
        np.minimum(np.minimum(f_left, f_mid), f_right),
    )
    i_a, i_m = np.unravel_index(int(profiled.argmin()), profiled.shape)
    step_b = log_b[1] - log_b[0]
    log_b_best = log_b[k[i_a, i_m]] + offset[i_a, i_m] * step_b
    theta_grid = np.array([problem.a_grid[i_a], math.exp(log_b_best), log_c_mid[i_m]])

    theta, sse_value = _polish(theta_grid, problem, fixed)
    num_points = y.size
    at_bounds = _params_at_bounds(theta, problem, fixed)
    if at_bounds:
        log.debug("curve fit ended on the bound of %s: the data do not pin it down", ", ".join(at_bounds))
    return CurveFit(
        a=float(theta[0]),
        b=float(theta[1]),
        c_mid=float(math.exp(theta[2])),
        r0=r0,
        sse=sse_value,
        rmse=math.sqrt(sse_value / num_points),
        num_points_used=num_points,
        cutoff_compute=problem.cutoff_compute,
        a_bounds=Interval(*problem.a_bounds),
        fixed_a=fixed,
        params_at_bounds=at_bounds,
    )


def _polish(theta_grid: FloatArray, problem: _Problem, fixed: bool) -> tuple[FloatArray, float]:
    """Continuous least squares from the grid winner; kept only if it lowers the SSE."""
    log_c, y, r0 = problem.log_c, problem.pass_rate, problem.r0
    free = [1, 2] if fixed else [0, 1, 2]
    lower = np.array([problem.a_bounds[0], math.exp(problem.log_b_bounds[0]), problem.log_c_mid_bounds[0]])
    upper = np.array([problem.a_bounds[1], math.exp(problem.log_b_bounds[1]), problem.log_c_mid_bounds[1]])

    def full(x: FloatArray) -> FloatArray:
        theta = theta_grid.copy()
        theta[free] = x
        return theta[None, :]

    def fun(x: FloatArray) -> FloatArray:
        residual: FloatArray = residuals_and_jacobian(full(x), log_c, y, r0)[0][0]
        return residual

    def jac(x: FloatArray) -> FloatArray:
        columns = residuals_and_jacobian(full(x), log_c, y, r0)[1]
        return np.stack([columns[i][0] for i in free], axis=1)

    sse_grid = float((fun(theta_grid[free]) ** 2).sum())
    x0 = np.clip(theta_grid[free], lower[free], upper[free])
    try:
        result = least_squares(
            fun,
            x0,
            jac=jac,
            bounds=(lower[free], upper[free]),
            x_scale="jac",
            method="trf",
            ftol=1e-12,
            xtol=1e-12,
            gtol=1e-12,
        )
    except (ValueError, np.linalg.LinAlgError) as error:  # a failed polish leaves the grid winner
        log.debug("curve polish failed, keeping the grid winner: %s", error)
        return theta_grid, sse_grid
    sse_polished = float((result.fun**2).sum())
    in_bounds = bool(np.all(result.x >= lower[free]) and np.all(result.x <= upper[free]))
    if in_bounds and sse_polished < sse_grid:
        return full(result.x)[0], sse_polished
    return theta_grid, sse_grid


def _params_at_bounds(theta: FloatArray, problem: _Problem, fixed: bool) -> tuple[str, ...]:
    checks = [
        ("B", math.log(theta[1]), problem.log_b_bounds),
        ("C_mid", theta[2], problem.log_c_mid_bounds),
    ]
    if not fixed:
        checks.insert(0, ("A", theta[0], problem.a_bounds))
    names = []
    for name, value, (low, high) in checks:
        tolerance = _BOUND_RTOL * max(1.0, abs(low), abs(high))
        if value <= low + tolerance or value >= high - tolerance:
            names.append(name)
    return tuple(names)


def fit_curve(
    compute: ArrayLike,
    pass_rate: ArrayLike,
    r0: float,
    settings: CurveFitSettings | None = None,
    *,
    fixed_a: float | None = None,
) -> CurveFit:
    """Fit the sigmoid curve by the paper's procedure (arXiv 2510.13786).

    ``R0`` is held fixed; points with compute below the early cutoff are
    excluded; a grid over (A, C_mid) with B fitted by least squares at each
    node picks the least-squared-error winner, which a bounded continuous
    least-squares polish over (A, B, C_mid) refines. ``fixed_a`` holds A
    (the comparison procedure). ``compute`` is the run's cumulative compute
    in evaluation order (> 0, never decreasing), ``pass_rate`` the pass rate
    measured there (in [0, 1]) and ``r0`` the step-0 pass rate (in [0, 1]).
    Raises FitError naming what is wrong with the data: a non-finite,
    non-positive, decreasing or out-of-range value, too few points after the
    cutoff, constant compute or pass rates, or no gain over R0.
    """
    settings = settings or CurveFitSettings()
    problem = _prepare(compute, pass_rate, r0, settings, fixed_a)
    return _fit_problem(problem, settings, fixed=fixed_a is not None)


def _quantile_levels(level: float) -> list[float]:
    return [(1.0 - level) / 2.0, (1.0 + level) / 2.0]


def bootstrap_intervals(
    compute: ArrayLike,
    pass_rate: ArrayLike,
    r0: float,
    settings: CurveFitSettings | None,
    fit: CurveFit,
    targets: Sequence[float] = (),
) -> Intervals:
    """Percentile bootstrap intervals for A, B, C_mid and the pass rate at ``targets``.

    Residual bootstrap (default) keeps the compute values and adds resampled,
    centred residuals of ``fit`` to its fitted values, inflated by
    sqrt(n / (n - p)) because least-squares residuals understate the noise by
    the p fitted parameters; point bootstrap resamples (compute, pass rate)
    pairs, done as multinomial weights on the original points so every
    resample shares one sigmoid table. Each resample is refitted by a coarse
    (C_mid, B) grid with A profiled out in closed form, then a vectorised
    Levenberg-Marquardt polish from that node or from ``fit``, whichever fits
    the resample better. Intervals are conditional on R0 and on the cutoff.
    """
    settings = settings or CurveFitSettings()
    target_compute = tuple(float(t) for t in targets)
    if any(not math.isfinite(t) or t <= 0 for t in target_compute):
        raise FitError(f"target compute values must be finite and > 0, got {target_compute}")
    fixed_a = fit.a if fit.fixed_a else None
    problem = _prepare(compute, pass_rate, r0, settings, fixed_a)
    log_c, y = problem.log_c, problem.pass_rate
    num_points, num_resamples = y.size, settings.num_bootstrap_resamples
    rng = np.random.default_rng(settings.rng_seed)

    if settings.bootstrap_kind == "residual":
        fitted = fit.predict(np.exp(log_c))
        residual = y - fitted
        residual = residual - residual.mean()
        num_params = 2 if fit.fixed_a else 3
        if num_points > num_params:
            residual = residual * math.sqrt(num_points / (num_points - num_params))
        index = rng.integers(0, num_points, size=(num_resamples, num_points))
        targets_y = fitted[None, :] + residual[index]
        weights = np.ones_like(targets_y)
    else:
        targets_y = np.broadcast_to(y, (num_resamples, num_points)).copy()
        weights = rng.multinomial(num_points, np.full(num_points, 1.0 / num_points), size=num_resamples)
        weights = weights.astype(np.float64)

    theta = _refit_batch(problem, targets_y, weights, fit)
    return intervals_from_samples(
        settings.interval_level, theta[:, 0], theta[:, 1], np.exp(theta[:, 2]), r0, target_compute
    )


def resampled_intervals(
    compute: ArrayLike,
    pass_rate: ArrayLike,
    resampled: ArrayLike,
    r0: float,
    settings: CurveFitSettings | None,
    fit: CurveFit,
    targets: Sequence[float] = (),
) -> Intervals:
    """Intervals from resamples the caller drew: each row of ``resampled`` (K x len(compute)) is the run's pass
    rates at ``compute`` in one resample, refitted as ``bootstrap_intervals`` refits its own.

    For resamples that must line up across runs: drawing the held-out prompts with replacement, the same
    draws for every run, makes two runs' samples pair row by row (a paired bootstrap; ``decision.decide``
    with ``paired=True``). ``pass_rate`` is the observed curve (it sets the cutoff and the search ranges, as
    for ``fit``); the early cutoff drops the same columns of every row. Intervals are conditional on R0.
    """
    settings = settings or CurveFitSettings()
    target_compute = tuple(float(t) for t in targets)
    if any(not math.isfinite(t) or t <= 0 for t in target_compute):
        raise FitError(f"target compute values must be finite and > 0, got {target_compute}")
    c = np.asarray(compute, dtype=np.float64)
    rows = np.asarray(resampled, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] != c.size:
        raise FitError(f"resampled must be K x {c.size} pass rates (one row a resample), got shape {rows.shape}")
    if not np.all(np.isfinite(rows)):
        raise FitError("resampled pass rates must be finite")
    problem = _prepare(c, pass_rate, r0, settings, fit.a if fit.fixed_a else None)
    targets_y = rows[:, c >= problem.cutoff_compute]
    theta = _refit_batch(problem, targets_y, np.ones_like(targets_y), fit)
    return intervals_from_samples(
        settings.interval_level, theta[:, 0], theta[:, 1], np.exp(theta[:, 2]), r0, target_compute
    )


def _refit_batch(problem: _Problem, targets_y: FloatArray, weights: FloatArray, fit: CurveFit) -> FloatArray:
    """Refit K weighted datasets (rows of ``targets_y`` at the problem's compute) at once: rows (A, B, ln C_mid).

    Each is located on a coarse (C_mid, B) grid with A profiled out in closed form, then polished by a
    vectorised Levenberg-Marquardt from that node or from ``fit``, whichever fits the dataset better.
    """
    log_c, r0 = problem.log_c, problem.r0
    num_resamples = targets_y.shape[0]
    theta_fit = np.array([fit.a, fit.b, math.log(fit.c_mid)])
    log_c_mid = np.linspace(*problem.log_c_mid_bounds, _BOOT_NUM_C_MID)
    log_b = np.linspace(*problem.log_b_bounds, _BOOT_NUM_B)
    gain = targets_y - r0
    s1, s2 = sigmoid_sums(log_c, log_c_mid, log_b, weights * gain, weights)
    y2 = (weights * gain**2).sum(axis=1)[:, None, None]
    if fit.fixed_a:
        a = np.full_like(s1, fit.a - r0)
    else:
        # The SSE is quadratic in the gain a = A - R0 at fixed (C_mid, B):
        # its minimiser S1/S2, clipped into the A range, is exact.
        a = np.clip(s1 / np.maximum(s2, 1e-300), problem.a_bounds[0] - r0, problem.a_bounds[1] - r0)
    sse = y2 - 2.0 * a * s1 + a * a * s2
    flat = sse.reshape(num_resamples, -1).argmin(axis=1)
    i_m, i_b = np.unravel_index(flat, sse.shape[1:])
    theta_grid = np.stack([r0 + a[np.arange(num_resamples), i_m, i_b], np.exp(log_b[i_b]), log_c_mid[i_m]], axis=1)

    free = np.array([0.0 if fit.fixed_a else 1.0, 1.0, 1.0])
    lower = np.array([problem.a_bounds[0], math.exp(problem.log_b_bounds[0]), problem.log_c_mid_bounds[0]])
    upper = np.array([problem.a_bounds[1], math.exp(problem.log_b_bounds[1]), problem.log_c_mid_bounds[1]])
    # Polish from whichever start fits the resample better: the coarse node
    # (right basin when the resample moved far) or the point estimate (close
    # already when it did not).
    theta_fit_rows = np.broadcast_to(np.clip(theta_fit, lower, upper), theta_grid.shape)
    theta_grid = np.clip(theta_grid, lower, upper)
    grid_better = weighted_sse(theta_grid, log_c, targets_y, weights, r0) <= weighted_sse(
        theta_fit_rows, log_c, targets_y, weights, r0
    )
    starts = np.where(grid_better[:, None], theta_grid, theta_fit_rows)
    theta, _ = polish_batch(starts, log_c, targets_y, weights, r0, free, lower, upper)
    return theta


def intervals_from_samples(
    level: float,
    a_samples: FloatArray,
    b_samples: FloatArray,
    c_mid_samples: FloatArray,
    r0: float,
    target_compute: Sequence[float] = (),
) -> Intervals:
    """Percentile intervals at ``level`` of the parameters' samples and of the pass rate they project at
    ``target_compute``; the samples are kept, in their order."""
    q = _quantile_levels(level)
    targets = tuple(float(t) for t in target_compute)
    projections: list[Interval] = []
    if targets:
        curves = predict(np.array(targets)[None, :], a_samples[:, None], b_samples[:, None], c_mid_samples[:, None], r0)
        low, high = np.quantile(curves, q, axis=0)
        projections = [Interval(float(lo), float(hi)) for lo, hi in zip(low, high)]

    def interval(samples: FloatArray) -> Interval:
        low_value, high_value = np.quantile(samples, q)
        return Interval(float(low_value), float(high_value))

    return Intervals(
        level=level,
        a=interval(a_samples),
        b=interval(b_samples),
        c_mid=interval(c_mid_samples),
        target_compute=targets,
        projection=tuple(projections),
        r0=float(r0),
        a_samples=a_samples,
        b_samples=b_samples,
        c_mid_samples=c_mid_samples,
    )
