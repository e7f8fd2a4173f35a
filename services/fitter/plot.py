"""The curve plot: observed pass rates, fitted sigmoids, extrapolations.

Owns drawing one PNG for one or several runs, each labelled with whether its
fit is determined: a determined fit's curve is drawn on through its
extrapolation with A as a dashed line and the projected value at the end;
an undetermined fit's only as the bootstrap band past the data, with "not
determined" and its interval for A, and no line at A. The live fitter and
``asymptote fit`` draw to one horizon: the budget when one is set, else
twice the largest compute. Knows nothing about fitting (it is handed
CurveFit, Intervals and their Determination) or about files beyond the PNG
it writes.
Uses matplotlib's object API with the Agg canvas, never pyplot, so it holds
no global figure state, needs no display, and changes no backend for anyone
else in the process.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from asymptote.compute import ComputeUnit
from services.fitter.curve import CurveFit, Intervals
from services.fitter.decision import Determination, determination

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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
    determination: Determination | None = None
    """Whether the fit is determined; None: judged here from the fit and its intervals."""

    @property
    def determined(self) -> bool:
        if self.fit is None or self.intervals is None:
            return False
        judged = self.determination or determination(self.fit, self.intervals)
        return judged.determined

    @property
    def why_not(self) -> str:
        if self.fit is None or self.intervals is None:
            return "no fit"
        return (self.determination or determination(self.fit, self.intervals)).why_not


def compute_axis_label(unit: ComputeUnit) -> str:
    """The x-axis label of a curve on ``unit``."""
    return "cumulative training compute (FLOPs)" if unit == "flops" else "cumulative compute (device-seconds held)"


HORIZON_MULTIPLE = 2.0
"""Without a budget, curves are drawn to this multiple of the largest compute, live and offline alike."""


def _legend_label(series: PlotSeries) -> str:
    fit, intervals = series.fit, series.intervals
    if fit is None or intervals is None:
        return f"{series.name} (no fit)"
    a_range = f"[{intervals.a.low:.3f}, {intervals.a.high:.3f}]"
    if not series.determined:
        return f"{series.name}: not determined, A in {a_range}"
    return f"{series.name}: determined, A={fit.a:.3f} {a_range}, B={fit.b:.2f}, C_mid={fit.c_mid:.3g}"


def plot_curves(
    series: Sequence[PlotSeries],
    path: Path,
    target_compute: float | None = None,
    title: str | None = None,
    compute_label: str = compute_axis_label("flops"),
) -> Path:
    """Draw the runs (``draw_curves``) into a PNG at ``path`` and return the path."""
    figure = draw_curves(series, target_compute, title, compute_label)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    log.debug("wrote curve plot %s", path)
    return path


def draw_curves(
    series: Sequence[PlotSeries],
    target_compute: float | None = None,
    title: str | None = None,
    compute_label: str = compute_axis_label("flops"),
) -> Figure:
    """The runs drawn into a matplotlib Figure (Agg canvas, no pyplot).

    Per run: used points filled, points excluded by the early cutoff hollow,
    R0 as a dotted line, the bootstrap band shaded up to ``target_compute``
    (the budget; default ``HORIZON_MULTIPLE`` x the largest observed
    compute) and the fitted curve solid over the observed range. A
    determined fit's curve goes on dashed to the horizon, with A as a dashed
    horizontal line and the projected value written at the end; an
    undetermined fit shows the band alone past its data, "not determined"
    and why in a note, and no line at A. Compute is on a log axis, so points
    with compute <= 0 (a step-0 evaluation) are left out; R0's line stands
    for them.
    """
    from matplotlib import rcParams
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not series:
        raise ValueError("draw_curves needs at least one run to draw")
    figure = Figure(figsize=(9.0, 5.5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    colors: list[str] = list(rcParams["axes.prop_cycle"].by_key()["color"])

    max_compute = max(
        (float(np.max(np.asarray(s.compute, dtype=np.float64))) for s in series if np.size(s.compute)), default=1.0
    )
    end = target_compute if target_compute is not None else HORIZON_MULTIPLE * max_compute
    notes: list[str] = []
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
        determined = run.determined
        axes.plot(grid[inside], curve[inside], color=color, linewidth=1.8)
        if run.intervals is not None:
            low, high = run.intervals.band(grid)
            what = "bootstrap band" if determined else "bootstrap band (not determined)"
            axes.fill_between(
                grid,
                low,
                high,
                color=color,
                alpha=0.18,
                linewidth=0,
                label=f"{run.name}: {run.intervals.level:.0%} {what}",
            )
        axes.axhline(fit.r0, color=color, linestyle=":", linewidth=1.0, alpha=0.8)
        if not determined:
            notes.append(f"{run.name}: not determined: {run.why_not}")
            continue
        axes.plot(grid[~inside], curve[~inside], color=color, linewidth=1.8, linestyle=(0, (4, 2)))
        axes.axhline(fit.a, color=color, linestyle="--", linewidth=1.0, alpha=0.8)
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
        axes.axvline(target_compute, color="grey", linestyle=":", linewidth=1.0, label="budget")
    if notes:
        # Wrapped to the figure's width: a reason is a sentence or two.
        axes.text(
            0.01,
            0.99,
            "\n".join(textwrap.fill(note, 110) for note in notes),
            transform=axes.transAxes,
            fontsize=7,
            va="top",
            ha="left",
            color="#8a5a00",
        )
    axes.set_xscale("log")
    axes.set_xlabel(compute_label)
    axes.set_ylabel("validation pass rate")
    axes.set_title(title or "pass rate vs compute: fitted sigmoid (dashed: a determined fit's A; dotted: R0)")
    axes.grid(True, which="both", alpha=0.25)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    return figure
