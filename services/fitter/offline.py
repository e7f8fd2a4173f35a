"""The offline ``fit`` command: fit finished (or running) runs from their eval logs.

Owns choosing R0, running the curve fit, the bootstrap, the half-run check
and the recipe comparison over eval logs, and reporting: rich tables on the
terminal, ``fit.json`` and ``curve.png`` in the output directory. Knows
nothing about NATS or the live fitter service; the log format is
``evals.py``, the maths ``curve.py`` and ``holdout.py``, the drawing
``plot.py``.

R0 is the pass rate at step 0, or at the first step when there is no step
0; that point defines R0 and is not itself a point of the curve. Compute is
the cumulative training compute as the live fitter writes it: FLOPs, or
device-seconds held in logs written before the FLOPs axis (their rows have
no ``compute_unit``). Each fit says which axis it used, and runs are
compared only on the same one.

A mixture's eval log (rows tagged with their sub-task) is one curve per
sub-task, named ``run/sub-task`` and fitted as if alone; runs are compared
only with runs of the same sub-task.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from asymptote.cli_args import ArgumentParser
from asymptote.compute import COMPUTE_UNIT_LABELS, ComputeUnit, compute_text
from asymptote.config import load_config, log_resolved
from asymptote.logs import setup_logging
from services.fitter.curve import (
    CurveFit,
    CurveFitSettings,
    FitError,
    Interval,
    Intervals,
    TooFewPointsError,
    bootstrap_intervals,
    fit_curve,
)
from services.fitter.decision import (
    MARGIN,
    Determination,
    Recommendation,
    RunComparison,
    compare_runs,
    determination,
    recommend,
    summary_line,
)
from services.fitter.evals import EvalFileError, eval_log_tasks, read_eval_log, split_baseline
from services.fitter.holdout import project_from_half
from services.fitter.plot import PlotSeries, compute_axis_label, plot_curves

log = logging.getLogger(__name__)

EVAL_FILE_NAME = "eval.jsonl"
FIT_FILE_NAME = "fit.json"
DEFAULT_OUTPUT_DIR = "fit-report"
"""Offline output folder; never a run directory, whose fit.json the live fitter owns."""
PLOT_FILE_NAME = "curve.png"

EXIT_OK = 0
EXIT_BAD_INPUT = 2
"""An eval log could not be read, or a run's data cannot support a fit."""


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


def resolve_eval_path(path: Path) -> Path:
    """The eval log for ``path``: the file itself, or ``eval.jsonl`` inside a run directory."""
    candidate = path / EVAL_FILE_NAME if path.is_dir() else path
    if not candidate.is_file():
        where = f"run directory {path} has no {EVAL_FILE_NAME}" if path.is_dir() else f"{path} does not exist"
        raise EvalFileError(f"no eval log: {where}")
    return candidate


def load_run(path: Path, name: str, task: str | None = None) -> RunData:
    """Read a run's eval log (with ``task``, that sub-task's rows) and split off the R0 point (step 0,
    else the first step)."""
    eval_path = resolve_eval_path(path)
    records = read_eval_log(eval_path, task)
    baseline, rest = split_baseline(records)
    return RunData(
        name=name,
        eval_path=eval_path,
        compute=np.array([record.compute for record in rest], dtype=np.float64),
        pass_rate=np.array([record.pass_rate for record in rest], dtype=np.float64),
        r0=baseline.pass_rate,
        task=task,
        compute_unit=records[0].compute_unit,
    )


def load_runs(path: Path, name: str) -> list[RunData]:
    """A run's curves: its one curve, or one per sub-task of a mixture (named ``name/sub-task``)."""
    tasks = eval_log_tasks(resolve_eval_path(path))
    if not tasks:
        return [load_run(path, name)]
    return [load_run(path, f"{name}/{task}", task) for task in tasks]


def _run_names(paths: Sequence[Path]) -> list[str]:
    """Run names from directory names, made unique with a suffix where they clash."""
    names: list[str] = []
    for path in paths:
        base = (path if path.is_dir() else path.parent).resolve().name or str(path)
        name, suffix = base, 2
        while name in names:
            name, suffix = f"{base}-{suffix}", suffix + 1
        names.append(name)
    return names


def fit_run(
    data: RunData,
    settings: CurveFitSettings,
    targets: Sequence[float],
    half_run: bool = True,
    planned_compute: float | None = None,
) -> RunResult:
    """Fit one run with bootstrap intervals (a FitError becomes the result's error), recommend
    what to do at ``planned_compute`` (None: look to the asymptote), and with ``half_run``
    also check how well its first half projects its end."""
    run_targets = tuple(targets) or ((2.0 * float(data.compute.max()),) if data.compute.size else ())
    if planned_compute is not None and planned_compute not in run_targets:
        run_targets = (*run_targets, planned_compute)
    check = project_from_half(data.compute, data.pass_rate, data.r0, settings) if half_run else None
    try:
        fit = fit_curve(data.compute, data.pass_rate, data.r0, settings)
        intervals = bootstrap_intervals(data.compute, data.pass_rate, data.r0, settings, fit, run_targets)
    except FitError as error:
        young = isinstance(error, TooFewPointsError)
        return RunResult(data=data, targets=run_targets, error=str(error), half_run=check, young=young)
    advice = recommend(fit, intervals, float(data.compute.max()), planned_compute)
    return RunResult(
        data=data,
        targets=run_targets,
        fit=fit,
        intervals=intervals,
        half_run=check,
        recommendation=advice,
        determination=determination(fit, intervals),
    )


def _interval_json(interval: Interval) -> list[float]:
    return [interval.low, interval.high]


def run_summary(result: RunResult) -> dict[str, Any]:
    """The JSON object ``fit.json`` holds for one run."""
    summary: dict[str, Any] = {
        "eval_path": str(result.data.eval_path),
        "compute_unit": result.data.compute_unit,
        "r0": result.data.r0,
    }
    if result.half_run is not None:
        summary["half_run_projection"] = result.half_run
    if result.fit is None or result.intervals is None:
        summary["error"] = result.error
        summary["determined"] = False
        summary["why_not_determined"] = result.error
        summary["not_determined"] = []
        return summary
    fit, intervals = result.fit, result.intervals
    judged = determination(fit, intervals)
    summary.update(
        a=fit.a,
        b=fit.b,
        c_mid=fit.c_mid,
        rmse=fit.rmse,
        sse=fit.sse,
        num_points_used=fit.num_points_used,
        cutoff_compute=fit.cutoff_compute,
        params_at_bounds=list(fit.params_at_bounds),
        at_bound=list(fit.params_at_bounds),
        identifiable=fit.identifiable,
        determined=judged.determined,
        why_not_determined=judged.why_not,
        not_determined=[shortfall.kind for shortfall in judged.shortfalls],
        intervals={
            "level": intervals.level,
            "a": _interval_json(intervals.a),
            "b": _interval_json(intervals.b),
            "c_mid": _interval_json(intervals.c_mid),
        },
        projections=[
            {"compute": target, "pass_rate": float(fit.predict(target)), "interval": _interval_json(interval)}
            for target, interval in zip(intervals.target_compute, intervals.projection)
        ],
    )
    if result.recommendation is not None:
        summary["recommendation"] = result.recommendation.action
        summary["recommendation_reason"] = result.recommendation.reason
    return summary


def _format_interval(interval: Interval, digits: int) -> str:
    return f"[{interval.low:.{digits}f}, {interval.high:.{digits}f}]"


def _table(title: str, columns: Sequence[str], caption: str | None = None) -> Table:
    """A compact table (numbers and names only): the long texts go below it as notes, so that nothing is
    cut at 80 columns."""
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, padding=(0, 1), title_justify="left")
    for column in columns:
        table.add_column(column, justify="left" if column == "run" else "right", overflow="fold")
    return table


def _print_notes(console: Console, notes: Sequence[tuple[str, str]]) -> None:
    """Each run's long text on lines of its own, wrapped at the console's width (never cut)."""
    for name, text in notes:
        console.print(f"[bold]{escape(name)}[/bold]: {text}", highlight=False)


def _unit_label(results: Sequence[RunResult]) -> str:
    """The compute unit of the runs' axis for a table header: one unit, or each run's own."""
    units = {r.data.compute_unit for r in results}
    return COMPUTE_UNIT_LABELS[units.pop()] if len(units) == 1 else "each run's unit"


def _runs_table(results: Sequence[RunResult]) -> tuple[Table, list[tuple[str, str]]]:
    """The fitted parameters, and per run its projections and advice (or why it failed)."""
    table = _table(
        "Sigmoid fit: R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)",
        ("run", "A [95% interval]", "B", f"C_mid ({_unit_label(results)})", "R0", "points", "RMSE"),
        caption="* at the bound of its search range: not pinned down by the data",
    )
    notes: list[tuple[str, str]] = []
    for result in results:
        fit, intervals = result.fit, result.intervals
        if fit is None or intervals is None:
            table.add_row(result.data.name, "[red]fit failed[/red]", "", "", f"{result.data.r0:.3f}", "", "")
            notes.append((result.data.name, f"[red]fit failed: {escape(result.error or '')}[/red]"))
            continue
        judged = result.determination or determination(fit, intervals)
        advice = result.recommendation
        if judged.determined:
            said = "; ".join(
                f"projected {float(fit.predict(target)):.3f} {_format_interval(interval, 3)} at {compute_text(target, result.data.compute_unit)}"
                for target, interval in zip(intervals.target_compute, intervals.projection)
            )
            if advice is not None:
                said += f"; {advice.action}: {advice.reason}"
        else:
            # An undetermined fit's projection reads like a real one: show what would determine it instead.
            action = f"{advice.action}: " if advice is not None else ""
            said = f"[yellow]{escape(action)}not yet determined: {escape(judged.why_not)}[/yellow]"
        notes.append((result.data.name, f"B {_format_interval(intervals.b, 2)}; {said}"))
        bound = {name: "*" if name in fit.params_at_bounds else "" for name in ("A", "B", "C_mid")}
        table.add_row(
            result.data.name,
            f"{fit.a:.3f}{bound['A']} {_format_interval(intervals.a, 3)}",
            f"{fit.b:.2f}{bound['B']}",
            f"{fit.c_mid:.4g}{bound['C_mid']}",
            f"{fit.r0:.3f}",
            str(fit.num_points_used),
            f"{fit.rmse:.4f}",
        )
    return table, notes


def _half_run_table(results: Sequence[RunResult]) -> tuple[Table, list[tuple[str, str]]]:
    table = _table(
        "Half-run check: fit on the first half of the compute, projected to the end",
        ("run", f"half compute ({_unit_label(results)})", "points", "projected", "measured", "error"),
    )
    notes: list[tuple[str, str]] = []
    for result in results:
        check = result.half_run
        if check is None:
            continue
        if check["projected"] is None:
            table.add_row(result.data.name, "", "", "-", "", "")
            notes.append((result.data.name, f"[red]half-run check: {escape(check['reason'])}[/red]"))
            continue
        low, high = check["interval"]
        table.add_row(
            result.data.name,
            f"{check['half_compute']:.4g}",
            str(check["points_used"]),
            f"{check['projected']:.3f} [{low:.3f}, {high:.3f}]",
            f"{check['measured']:.3f}",
            f"{check['error']:+.3f}",
        )
    return table, notes


def _comparison_table(rows: Sequence[RunComparison], margin: float) -> tuple[Table, list[tuple[str, str]]]:
    table = _table(
        f"Recipe comparison (asymptotes within {margin} compared by B at their mean A)",
        ("rank", "run", "A [95% interval]", "B", "shared A", "B at shared A"),
    )
    notes: list[tuple[str, str]] = []
    for row in rows:
        table.add_row(
            "-" if row.rank is None else str(row.rank),
            row.name,
            f"{row.a:.3f} {_format_interval(row.a_interval, 3)}",
            f"{row.b:.2f}",
            "" if row.shared_a is None else f"{row.shared_a:.3f}",
            "" if row.b_at_shared_a is None else f"{row.b_at_shared_a:.2f}",
        )
        decided = "" if row.decided_by == "undecided" else f"decided by {escape(row.decided_by)}: "
        notes.append((row.name, f"{decided}{escape(row.verdict)}"))
    notes.append(("comparison", escape(summary_line(rows))))
    return table, notes


def _with_rivals(results: list[RunResult], budget: float | None, margin: float) -> list[RunResult]:
    """Each run's recommendation, redone knowing the other runs: "compare" where a
    determined rival's A is within ``margin``."""
    asymptotes = {
        r.data.name: r.fit.a
        for r in results
        if r.fit is not None and r.determination is not None and r.determination.determined
    }
    out = []
    for r in results:
        if r.fit is None or r.intervals is None:
            out.append(r)
            continue
        same_task = {o.data.name for o in results if o.data.task == r.data.task}
        rivals = {name: a for name, a in asymptotes.items() if name != r.data.name and name in same_task}
        advice = recommend(r.fit, r.intervals, float(r.data.compute.max()), budget, margin, rivals)
        out.append(replace(r, recommendation=advice))
    return out


def plot_run(run_dir: Path, run_name: str, settings: CurveFitSettings, targets: Sequence[float] = ()) -> Path:
    """Fit the run in ``run_dir`` and draw ``curve.png`` there (the live fitter's plot).

    A run that cannot be fitted yet is drawn with its points only.
    """
    result = fit_run(load_run(run_dir, run_name), settings, targets, half_run=False)
    return plot_curves(
        [PlotSeries(run_name, result.data.compute, result.data.pass_rate, result.fit, result.intervals)],
        run_dir / PLOT_FILE_NAME,
        target_compute=max(result.targets, default=None),
        compute_label=compute_axis_label(result.data.compute_unit),
    )


def main_fit(
    paths: list[Path],
    output_dir: Path | None,
    settings: CurveFitSettings,
    targets: Sequence[float],
    console: Console | None = None,
    margin: float = MARGIN,
    error_console: Console | None = None,
    budget: float | None = None,
) -> int:
    """Fit each run's eval log, print the tables, write fit.json and curve.png.

    ``paths`` are eval logs or run directories holding ``eval.jsonl``;
    ``output_dir`` defaults to ./fit-report (a run directory's fit.json
    belongs to the live fitter). ``targets`` are compute values to project
    to (default: twice each run's largest compute). Every run also gets the
    half-run check and a recommendation (continue, stop, or compare when
    another run's A is within ``margin``) at ``budget`` (None: the
    asymptote). With several runs the comparison table is printed and
    stored too. Errors go to ``error_console`` (default: ``console`` if one
    is given, else stderr). Returns 0 on success and 2 on bad input: an
    input that could not be read (nothing is written), or a run whose data
    cannot support a fit (the reason is printed; the other runs are still
    reported and written).
    """
    if error_console is None:
        # soft_wrap: a refusal is one line however long its path, as every subcommand's is.
        error_console = console if console is not None else Console(stderr=True, soft_wrap=True)
    console = console or Console()

    def refuse(message: str) -> int:
        error_console.print(f"[red]asymptote fit: {message}[/red]")
        return EXIT_BAD_INPUT

    if not paths:
        return refuse("no eval logs or run directories given")
    if any(not math.isfinite(t) or t <= 0 for t in targets):
        return refuse(f"target compute values must be finite and > 0, got {list(targets)}")
    if not (math.isfinite(margin) and margin >= 0):
        return refuse(f"margin must be a finite pass-rate difference >= 0, got {margin}")
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        return refuse(f"--budget must be a finite compute > 0, got {budget}")
    try:
        runs = [data for path, name in zip(paths, _run_names(paths)) for data in load_runs(path, name)]
    except (EvalFileError, OSError) as error:
        return refuse(str(error))

    results = _with_rivals([fit_run(data, settings, targets, planned_compute=budget) for data in runs], budget, margin)
    for table, notes in (_runs_table(results), _half_run_table(results)):
        console.print(table)
        _print_notes(console, notes)
    comparison: list[RunComparison] = []
    verdicts: list[str] = []
    # Runs are compared on the same sub-task and the same compute axis only.
    for task, unit in dict.fromkeys((r.data.task, r.data.compute_unit) for r in results):
        fitted = {
            r.data.name: (r.data.compute, r.data.pass_rate, r.data.r0)
            for r in results
            if r.fit is not None and r.data.task == task and r.data.compute_unit == unit
        }
        if len(fitted) < 2:
            continue
        try:
            rows = compare_runs(fitted, settings, margin=margin)
        except FitError as error:
            error_console.print(f"[red]fit: comparison failed: {error}[/red]")
            continue
        if rows:
            table, notes = _comparison_table(rows, margin)
            console.print(table)
            _print_notes(console, notes)
            comparison += rows
            verdicts.append(summary_line(rows))

    out = output_dir if output_dir is not None else Path(DEFAULT_OUTPUT_DIR)
    try:
        out.mkdir(parents=True, exist_ok=True)
        report = {
            "settings": settings.model_dump(),
            "runs": {result.data.name: run_summary(result) for result in results},
            "comparison": [asdict(row) for row in comparison],
            "comparison_verdict": "; ".join(verdicts) if verdicts else None,
        }
        (out / FIT_FILE_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        target_compute = max((t for r in results for t in r.targets), default=None)
        plot_curves(
            [PlotSeries(r.data.name, r.data.compute, r.data.pass_rate, r.fit, r.intervals) for r in results],
            out / PLOT_FILE_NAME,
            target_compute=target_compute,
            compute_label=compute_axis_label(results[0].data.compute_unit),
        )
    except OSError as error:
        return refuse(f"cannot write the report to {out}: {error}")
    console.print(f"wrote {out / FIT_FILE_NAME} and {out / PLOT_FILE_NAME}")
    failed = [r for r in results if r.fit is None and not r.young]
    for result in results:
        if result.fit is None and result.young:
            console.print(f"fit: run {result.data.name!r} is too young to fit ({result.error}): run it longer")
    for result in failed:
        error_console.print(f"[red]fit: run {result.data.name!r} ({result.data.eval_path}): {result.error}[/red]")
    return EXIT_BAD_INPUT if failed else EXIT_OK


def main(argv: list[str]) -> int:
    """``asymptote fit``: parse arguments and settings, set up logging, run ``main_fit``.

    Settings come from ``--config`` (YAML/JSON holding CurveFitSettings
    fields) plus ``ASY_FIT__<FIELD>`` environment overrides; a bad value
    raises ConfigError, which the command line turns into exit code 2.
    """
    parser = ArgumentParser(
        prog="asymptote fit",
        description="Fit R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) to runs' eval.jsonl and project them.",
    )
    parser.add_argument("paths", nargs="+", type=Path, help="eval.jsonl files or run directories holding one")
    parser.add_argument(
        "-o", "--output-dir", type=Path, help=f"where fit.json and curve.png go (default: ./{DEFAULT_OUTPUT_DIR})"
    )
    parser.add_argument(
        "-t",
        "--target",
        type=float,
        action="append",
        default=[],
        help="compute to project the pass rate to (repeatable; default: twice each run's largest compute)",
    )
    parser.add_argument("--config", type=Path, help="YAML/JSON curve fit settings (env overrides: ASY_FIT__...)")
    parser.add_argument("--margin", type=float, default=MARGIN, help="asymptotes closer than this are compared by B")
    parser.add_argument(
        "--budget", type=float, help="planned compute to recommend continue/stop against (default: the asymptote)"
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    args = parser.parse_args(argv)
    setup_logging("fit", "text", args.log_level)
    settings = load_config(CurveFitSettings, args.config, "ASY_FIT")
    log_resolved(settings, "fit")
    return main_fit(args.paths, args.output_dir, settings, args.target, margin=args.margin, budget=args.budget)
