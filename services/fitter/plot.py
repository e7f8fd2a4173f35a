"""The curve plot: observed pass rates, fitted sigmoids, extrapolations.

Owns drawing one PNG for one or several runs. Knows nothing about fitting
(it is handed CurveFit and Intervals) or about files beyond the PNG it writes.
Uses matplotlib's object API with the Agg canvas, never pyplot, so it holds
no global figure state, needs no display, and changes no backend for anyone
else in the process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from asymptote.compute import ComputeUnit
from services.fitter.curve import CurveFit, Intervals

log = logging.getLogger(__name__)

# Points on the drawn curves; the x-axis is logarithmic so they are log-spaced.
_NUM_CURVE_POINTS = 300


@dataclass(frozen=True)
class PlotSeries:
    """One run to draw: its observed points and, if it could be fitted, its fit."""

    name: str
    compute: npt.ArrayLike
    pass_rate: npt.ArrayLike
    fit: CurveFit | None = None
    intervals: Intervals | None = None


def compute_axis_label(unit: ComputeUnit) -> str:
    """The x-axis label of a curve on ``unit``."""
    return "cumulative training compute (FLOPs)" if unit == "flops" else "cumulative compute (device-seconds held)"


def _legend_label(series: PlotSeries) -> str:
    fit = series.fit
    if fit is None:
        return f"{series.name} (no fit)"
    a_text = f"A={fit.a:.3f}"
    if series.intervals is not None:
        a_text += f" [{series.intervals.a.low:.3f}, {series.intervals.a.high:.3f}]"
    return f"{series.name}: {a_text}, B={fit.b:.2f}, C_mid={fit.c_mid:.4g}"


def plot_curves(
    series: Sequence[PlotSeries],
    path: Path,
    target_compute: float | None = None,
    title: str | None = None,
    compute_label: str = compute_axis_label("flops"),
) -> Path:
    """Draw the runs into a PNG at ``path`` and return the path.

    Per run: used points filled, points excluded by the early cutoff hollow,
    the fitted curve solid over the observed range and dashed beyond it up
    to ``target_compute`` (default: twice the largest observed compute), the
    bootstrap band shaded, A as a dashed horizontal line and R0 as a dotted
    one. Compute is on a log axis, so points with compute <= 0 (a step-0
    evaluation) are left out; R0's line stands for them.
    """
    from matplotlib import rcParams
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not series:
        raise ValueError("plot_curves needs at least one run to draw")
    figure = Figure(figsize=(9.0, 5.5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    colors: list[str] = list(rcParams["axes.prop_cycle"].by_key()["color"])

    max_compute = max(
        (float(np.max(np.asarray(s.compute, dtype=np.float64))) for s in series if np.size(s.compute)), default=1.0
    )
    end = target_compute if target_compute is not None else 2.0 * max_compute
    for index, run in enumerate(series):
        color = colors[index % len(colors)]
        compute = np.asarray(run.compute, dtype=np.float64)
        pass_rate = np.asarray(run.pass_rate, dtype=np.float64)
        positive = compute > 0
        compute, pass_rate = compute[positive], pass_rate[positive]
        fit = run.fit
        cutoff = fit.cutoff_compute if fit is not None else 0.0
        used = compute >= cutoff
        axes.scatter(compute[used], pass_rate[used], s=14, color=color, label=_legend_label(run), zorder=3)
        if np.any(~used):
            axes.scatter(
                compute[~used],
                pass_rate[~used],
                s=14,
                facecolors="none",
                edgecolors=color,
                label=f"{run.name}: excluded (compute < {cutoff:.4g})",
                zorder=3,
            )
        if fit is None or compute.size == 0:
            continue
        start = float(compute.min())
        observed_end = float(compute.max())
        run_end = max(end, observed_end)
        grid = np.geomspace(start, run_end, _NUM_CURVE_POINTS)
        inside = grid <= observed_end
        curve = fit.predict(grid)
        axes.plot(grid[inside], curve[inside], color=color, linewidth=1.8)
        axes.plot(grid[~inside], curve[~inside], color=color, linewidth=1.8, linestyle=(0, (4, 2)))
        if run.intervals is not None:
            low, high = run.intervals.band(grid)
            axes.fill_between(
                grid,
                low,
                high,
                color=color,
                alpha=0.18,
                linewidth=0,
                label=f"{run.name}: {run.intervals.level:.0%} bootstrap band",
            )
        axes.axhline(fit.a, color=color, linestyle="--", linewidth=1.0, alpha=0.8)
        axes.axhline(fit.r0, color=color, linestyle=":", linewidth=1.0, alpha=0.8)
        projected = float(fit.predict(run_end))
        axes.annotate(
            f"{projected:.3f}",
            (run_end, projected),
            textcoords="offset points",
            xytext=(4, 0),
            fontsize=8,
            color=color,
            va="center",
        )

    if target_compute is not None:
        axes.axvline(target_compute, color="grey", linestyle=":", linewidth=1.0, label="target compute")
    axes.set_xscale("log")
    axes.set_xlabel(compute_label)
    axes.set_ylabel("validation pass rate")
    axes.set_title(title or "pass rate vs compute: fitted sigmoid (dashed: A, dotted: R0)")
    axes.grid(True, which="both", alpha=0.25)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    log.debug("wrote curve plot %s", path)
    return path
