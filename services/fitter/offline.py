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
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from asymptote.cli_args import ArgumentParser
from asymptote.config import load_config, log_resolved
from asymptote.logs import setup_logging
from services.fitter.curve import (
    CurveFitSettings,
    FitError,
    Interval,
    TooFewPointsError,
    bootstrap_intervals,
    fit_curve,
)
from services.fitter.decision import (
    ALPHA,
    MARGIN,
    RunComparison,
    compare_runs,
    determination,
    recommend,
    summary_line,
)
from services.fitter.evals import EvalFileError, eval_log_tasks, read_eval_log, split_baseline
from services.fitter.holdout import project_from_half
from services.fitter.plot import PlotSeries, compute_axis_label, plot_curves
from services.fitter.report import Notes, RunData, RunResult, comparison_table, half_run_table, runs_table

log = logging.getLogger(__name__)

EVAL_FILE_NAME = "eval.jsonl"
FIT_FILE_NAME = "fit.json"
DEFAULT_OUTPUT_DIR = "fit-report"
"""Offline output folder; never a run directory, whose fit.json the live fitter owns."""
PLOT_FILE_NAME = "curve.png"

EXIT_OK = 0
EXIT_BAD_INPUT = 2
"""An eval log could not be read, or a run's data cannot support a fit."""


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
    """The JSON object ``fit.json`` holds for one run, led by whether its fit is determined.

    A determined fit states ``a``, ``b``, ``c_mid`` and each projection's ``pass_rate`` beside their
    intervals; an undetermined one states the intervals only, its point values kept apart under
    ``not_determined_point_estimates`` (they are not a forecast). A failed fit has its ``error``.
    """
    judged = result.determination
    summary: dict[str, Any] = {
        "determined": judged is not None and judged.determined,
        "why_not_determined": judged.why_not if judged is not None else result.error,
        "not_determined": [shortfall.kind for shortfall in judged.shortfalls] if judged is not None else [],
        "eval_path": str(result.data.eval_path),
        "compute_unit": result.data.compute_unit,
        "r0": result.data.r0,
    }
    if result.fit is None or result.intervals is None or judged is None:
        summary["error"] = result.error
        if result.half_run is not None:
            summary["half_run_projection"] = result.half_run
        return summary
    fit, intervals = result.fit, result.intervals
    summary["intervals"] = {
        "level": intervals.level,
        "a": _interval_json(intervals.a),
        "b": _interval_json(intervals.b),
        "c_mid": _interval_json(intervals.c_mid),
    }
    projected = [float(fit.predict(target)) for target in intervals.target_compute]
    if judged.determined:
        summary.update(a=fit.a, b=fit.b, c_mid=fit.c_mid)
        summary["projections"] = [
            {"compute": target, "pass_rate": rate, "interval": _interval_json(interval)}
            for target, rate, interval in zip(intervals.target_compute, projected, intervals.projection)
        ]
    else:
        summary["projections"] = [
            {"compute": target, "interval": _interval_json(interval)}
            for target, interval in zip(intervals.target_compute, intervals.projection)
        ]
        summary["not_determined_point_estimates"] = {
            "a": fit.a,
            "b": fit.b,
            "c_mid": fit.c_mid,
            "projected_pass_rates": projected,
        }
    summary.update(
        rmse=fit.rmse,
        sse=fit.sse,
        num_points_used=fit.num_points_used,
        cutoff_compute=fit.cutoff_compute,
        at_bound=list(fit.params_at_bounds),
        identifiable=fit.identifiable,
    )
    if result.recommendation is not None:
        summary["recommendation"] = result.recommendation.action
        summary["recommendation_reason"] = result.recommendation.reason
    if result.half_run is not None:
        summary["half_run_projection"] = result.half_run
    return summary


def _print(console: Console, table: Table, notes: Notes) -> None:
    """A table, then each row's long text on lines of its own, wrapped at the console's width (never cut)."""
    console.print(table)
    for name, text in notes:
        console.print(f"[bold]{escape(name)}[/bold]: {text}", highlight=False)


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
        [_series(result)], run_dir / PLOT_FILE_NAME, compute_label=compute_axis_label(result.data.compute_unit)
    )


def _series(result: RunResult) -> PlotSeries:
    return PlotSeries(
        result.data.name, result.data.compute, result.data.pass_rate, result.fit, result.intervals, result.determination
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
    alpha: float = ALPHA,
) -> int:
    """Fit each run's eval log, print the tables, write fit.json and curve.png.

    ``paths`` are eval logs or run directories holding ``eval.jsonl``;
    ``output_dir`` defaults to ./fit-report (a run directory's fit.json
    belongs to the live fitter). ``targets`` are compute values to project
    to (default: twice each run's largest compute). Every run also gets the
    half-run check and a recommendation (continue, stop, or compare when
    another run's A is within ``margin``) at ``budget`` (None: the
    asymptote). With several runs the comparison (``decision.compare_runs``,
    at the error rate ``alpha``, at ``budget`` or else at the compute every
    run reached) is printed and stored too. The plot draws to ``budget``,
    else to twice the largest compute, as the live fitter's does. Errors go
    to ``error_console`` (default: ``console`` if one is given, else
    stderr). Returns 0 on success and 2 on bad input: an input that could
    not be read or holds no curve point after R0 (nothing is written), or a
    run whose data cannot support a fit (the reason is printed; the other
    runs are still reported and written).
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
    if not 0.0 < alpha < 1.0:
        return refuse(f"--alpha must be an error rate in (0, 1), got {alpha}")
    try:
        runs = [data for path, name in zip(paths, _run_names(paths)) for data in load_runs(path, name)]
    except (EvalFileError, OSError) as error:
        return refuse(str(error))
    for data in runs:
        if data.compute.size == 0:
            # R0 alone is no curve: there is nothing to fit, to plot or to report.
            return refuse(f"{data.eval_path}: only R0's evaluation (step 0), no curve point after it")

    results = _with_rivals([fit_run(data, settings, targets, planned_compute=budget) for data in runs], budget, margin)
    _print(console, *runs_table(results))
    _print(console, *half_run_table(results))
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
            rows = compare_runs(fitted, settings, margin, alpha, budget, unit)
        except FitError as error:
            error_console.print(f"[red]fit: comparison failed: {error}[/red]")
            continue
        if rows:
            _print(console, *comparison_table(rows, unit))
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
        plot_curves(
            [_series(r) for r in results],
            out / PLOT_FILE_NAME,
            target_compute=budget,
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
    parser.add_argument(
        "--margin",
        type=float,
        default=MARGIN,
        help=f"pass-rate differences within this are equivalent, beyond it decided (default: {MARGIN})",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        default=ALPHA,
        help=f"the comparison's error rate: runs of one recipe come out decided at most this often (default: {ALPHA})",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="planned compute (the logs' axis unit) to recommend against and compare at (default: the asymptote)",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    args = parser.parse_args(argv)
    setup_logging("fit", "text", args.log_level)
    settings = load_config(CurveFitSettings, args.config, "ASY_FIT")
    log_resolved(settings, "fit")
    return main_fit(
        args.paths, args.output_dir, settings, args.target, margin=args.margin, budget=args.budget, alpha=args.alpha
    )
