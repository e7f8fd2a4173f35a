"""The ``asymptote fit`` terminal report: the fit, half-run and comparison tables and their notes.

Owns what a person reads on the terminal: compact tables of numbers and
names (each row led by whether its fit is determined), with the long texts
(reasons, verdicts, projections) printed below each table as notes wrapped
at the console's width, so that nothing is cut at 80 columns and a run's
name is never broken. An undetermined fit's A and projections appear only
as intervals, with the words "not determined". Holds the records it shows
(``RunData``, ``RunResult``); knows nothing about files: ``offline.py``
reads the logs, fits the runs and hands them here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich import box
from rich.markup import escape
from rich.table import Table

from asymptote.compute import COMPUTE_UNIT_LABELS, ComputeUnit, compute_interval_text, compute_text
from services.fitter.curve import CurveFit, Interval, Intervals
from services.fitter.decision import Determination, Recommendation, RunComparison, determination, summary_line


@dataclass(frozen=True)
class RunData:
    """A run's curve points and its R0, read from one eval log."""

    name: str
    eval_path: Path
    compute: npt.NDArray[np.float64]
    pass_rate: npt.NDArray[np.float64]
    r0: float
    task: str | None = None
    """The mixture's sub-task this curve is of; None for a single-task run."""
    compute_unit: ComputeUnit = "flops"
    """The axis ``compute`` is on: FLOPs, or device-seconds held (logs written before the FLOPs axis)."""


@dataclass(frozen=True)
class RunResult:
    """The outcome of fitting one run: a fit with intervals, or the reason it failed."""

    data: RunData
    targets: tuple[float, ...]
    fit: CurveFit | None = None
    intervals: Intervals | None = None
    error: str | None = None
    half_run: dict[str, Any] | None = None
    """The half-run check (``holdout.project_from_half``): fit on compute <= half the final, projected to it."""
    recommendation: Recommendation | None = None
    """Continue, stop or compare at the planned budget (``decision.recommend``)."""
    determination: Determination | None = None
    """Whether the fit is determined (``decision.determination``) and if not why; None without a fit."""
    young: bool = False
    """Not fitted only because it has too few points yet: a run to continue, not bad input."""


Notes = list[tuple[str, str]]
"""Each row's long text, by the name it is about."""


def interval_text(interval: Interval | Sequence[float], digits: int = 3) -> str:
    low, high = interval
    return f"[{low:.{digits}f}, {high:.{digits}f}]"


def _table(title: str, columns: Sequence[str]) -> Table:
    """A compact table whose run names are never wrapped (the other columns fold first)."""
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), title_justify="left")
    for column in columns:
        if column == "run":
            table.add_column(column, justify="left", no_wrap=True)
        else:
            table.add_column(column, justify="right", overflow="fold")
    return table


def unit_label(units: Sequence[ComputeUnit]) -> str:
    """The compute unit of the runs' axis for a table header: one unit, or each run's own."""
    distinct = set(units)
    return COMPUTE_UNIT_LABELS[distinct.pop()] if len(distinct) == 1 else "each run's unit"


def runs_table(results: Sequence[RunResult]) -> tuple[Table, Notes]:
    """The fits, each led by whether it is determined; per run its projections and advice as a note."""
    unit = unit_label([r.data.compute_unit for r in results])
    table = _table(
        f"Sigmoid fit R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), C in {unit}",
        ("run", "determined", "A [95%]", "B", "C_mid"),
    )
    notes: Notes = []
    for result in results:
        fit, intervals, run_unit = result.fit, result.intervals, result.data.compute_unit
        if fit is None or intervals is None:
            table.add_row(result.data.name, "no", "[red]fit failed[/red]", "", "")
            notes.append((result.data.name, f"[red]fit failed: {escape(result.error or '')}[/red]"))
            continue
        judged = result.determination or determination(fit, intervals)
        advice = result.recommendation
        base = f"{fit.num_points_used} points, R0 {fit.r0:.3f}, RMSE {fit.rmse:.4f}; B {interval_text(intervals.b, 2)}"
        if judged.determined:
            projected = "; ".join(
                f"projected {float(fit.predict(target)):.3f} {interval_text(interval)} at {compute_text(target, run_unit)}"
                for target, interval in zip(intervals.target_compute, intervals.projection)
            )
            said = f"{base}, C_mid {compute_text(fit.c_mid, run_unit, *intervals.c_mid)}; {projected}"
            if advice is not None:
                said += f"; {escape(advice.action)}: {escape(advice.reason)}"
            a_cell = f"{fit.a:.3f} {interval_text(intervals.a)}"
            table.add_row(result.data.name, "yes", a_cell, f"{fit.b:.2f}", f"{fit.c_mid:.3g}")
        else:
            # An undetermined fit's point values read like real ones: its intervals only, and why.
            projected = "; ".join(
                f"at {compute_text(target, run_unit)} in {interval_text(interval)}"
                for target, interval in zip(intervals.target_compute, intervals.projection)
            )
            said = (
                f"[yellow]not determined: {escape(judged.why_not)}[/yellow]; {base}, "
                f"C_mid in {compute_interval_text(*intervals.c_mid, run_unit)}; projected (not determined) {projected}"
            )
            table.add_row(result.data.name, "[yellow]no[/yellow]", f"in {interval_text(intervals.a)}", "", "")
        notes.append((result.data.name, said))
    return table, notes


_VERDICT_CELLS = {"landed": "landed", "missed": "[red]missed[/red]", "not_determined": "[yellow]can't say[/yellow]"}


def half_run_table(results: Sequence[RunResult]) -> tuple[Table, Notes]:
    """Each run's half-run check (``holdout.project_from_half``) with its verdict."""
    table = _table(
        "Half-run check: the first half's fit projected to the end",
        ("run", "projected [95%]", "measured", "error", "verdict"),
    )
    notes: Notes = []
    for result in results:
        check: dict[str, Any] | None = result.half_run
        if check is None:
            continue
        verdict = _VERDICT_CELLS[check["verdict"]]
        measured = "" if check["measured"] is None else f"{check['measured']:.3f}"
        if check["interval"] is None:
            table.add_row(result.data.name, "-", measured, "", verdict)
        elif check["determined"]:
            projected = f"{check['projected']:.3f} {interval_text(check['interval'])}"
            table.add_row(result.data.name, projected, measured, f"{check['error']:+.3f}", verdict)
        else:
            table.add_row(result.data.name, f"in {interval_text(check['interval'])}", measured, "", verdict)
        points = f"{check['points_used']} points in the first half" if check["points_used"] else "no fit"
        notes.append((result.data.name, f"half-run check ({points}): {escape(check['verdict_text'])}"))
    return table, notes


def comparison_table(rows: Sequence[RunComparison], compute_unit: ComputeUnit) -> tuple[Table, Notes]:
    """The comparison (``decision.compare_runs``): determined runs by rank, then those not ranked."""
    target = compute_text(rows[0].target_compute, compute_unit) if rows else ""
    table = _table(
        f"Recipe comparison at {target}: decided only where the intervals say",
        ("rank", "run", "determined", "pass rate [95%]"),
    )
    notes: Notes = []
    for row in rows:
        if row.determined:
            rate = f"{row.pass_rate_at_target:.3f} {interval_text(row.pass_rate_interval)}"
            table.add_row(str(row.rank), row.name, "yes", rate)
        else:
            table.add_row("-", row.name, "[yellow]no[/yellow]", f"in {interval_text(row.pass_rate_interval)}")
        notes.append((row.name, escape(row.verdict)))
    notes.append(("comparison", escape(summary_line(rows))))
    return table, notes
