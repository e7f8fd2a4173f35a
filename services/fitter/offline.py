"""The offline ``fit`` command: fit finished (or running) runs from their eval logs.

Owns reading ``eval.jsonl`` files, choosing R0, running the curve fit, the
bootstrap and the recipe comparison, and reporting: a rich table on the
terminal, ``fit.json`` and ``curve.png`` in the output directory. Knows
nothing about NATS or the live fitter service; the maths lives in
``curve.py`` and the drawing in ``plot.py``.

``eval.jsonl`` holds one JSON object per line with at least ``step``,
``policy_version``, ``compute`` (cumulative, accelerator-hours) and
``pass_rate``; other keys are ignored. R0 is the pass rate at step 0, or at
the smallest compute when there is no step 0; that point defines R0 and is
not itself a point of the curve.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.console import Console
from rich.table import Table

from asymptote.config import load_config, log_resolved
from asymptote.errors import AsymptoteError
from asymptote.logs import setup_logging
from services.fitter.curve import (
    CurveFit,
    CurveFitSettings,
    FitError,
    Interval,
    Intervals,
    RunComparison,
    bootstrap_intervals,
    compare_runs,
    fit_curve,
)
from services.fitter.plot import PlotSeries, plot_curves

log = logging.getLogger(__name__)

EVAL_FILE_NAME = "eval.jsonl"
FIT_FILE_NAME = "fit.json"
DEFAULT_OUTPUT_DIR = "fit-report"
"""Offline output folder; never a run directory, whose fit.json the live fitter owns."""
PLOT_FILE_NAME = "curve.png"

EXIT_OK = 0
EXIT_FIT_FAILED = 1
EXIT_BAD_INPUT = 2


class EvalFileError(AsymptoteError, ValueError):
    """An eval log is missing or has a bad line; the message names the file and line."""


class EvalRecord(BaseModel):
    """One evaluation pass as written to ``eval.jsonl``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    step: int = Field(ge=0)
    """Learner step the evaluated policy came from."""
    policy_version: int = Field(ge=0)
    """Policy version that was evaluated."""
    compute: float = Field(ge=0.0, allow_inf_nan=False)
    """Cumulative training compute at that version (accelerator-hours)."""
    pass_rate: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    """Mean pass rate over the held-out prompts and samples."""


@dataclass(frozen=True)
class RunData:
    """A run's curve points and its R0, read from one eval log."""

    name: str
    eval_path: Path
    compute: npt.NDArray[np.float64]
    pass_rate: npt.NDArray[np.float64]
    r0: float


@dataclass(frozen=True)
class RunResult:
    """The outcome of fitting one run: a fit with intervals, or the reason it failed."""

    data: RunData
    targets: tuple[float, ...]
    fit: CurveFit | None = None
    intervals: Intervals | None = None
    error: str | None = None


def resolve_eval_path(path: Path) -> Path:
    """The eval log for ``path``: the file itself, or ``eval.jsonl`` inside a run directory."""
    candidate = path / EVAL_FILE_NAME if path.is_dir() else path
    if not candidate.is_file():
        where = f"run directory {path} has no {EVAL_FILE_NAME}" if path.is_dir() else f"{path} does not exist"
        raise EvalFileError(f"no eval log: {where}")
    return candidate


def read_eval_log(path: Path) -> list[EvalRecord]:
    """Parse an eval log; blank lines are skipped, a repeated step keeps its last record.

    A repeated step happens when a run resumed from a checkpoint re-evaluates
    the same policy; the later record is the one the run continued from.
    """
    by_step: dict[int, EvalRecord] = {}
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as error:
                raise EvalFileError(f"{path}:{line_number}: not valid JSON ({error.msg})") from error
            if not isinstance(raw, dict):
                raise EvalFileError(f"{path}:{line_number}: expected a JSON object, got {type(raw).__name__}")
            try:
                record = EvalRecord.model_validate(raw)
            except ValidationError as error:
                problems = "; ".join(
                    f"{'.'.join(str(part) for part in issue['loc'])}: {issue['msg']}" for issue in error.errors()
                )
                raise EvalFileError(f"{path}:{line_number}: {problems}") from error
            by_step[record.step] = record
    if not by_step:
        raise EvalFileError(f"{path}: no evaluation records")
    return sorted(by_step.values(), key=lambda record: (record.compute, record.step))


def load_run(path: Path, name: str) -> RunData:
    """Read a run's eval log and split off the R0 point (step 0, else the smallest compute)."""
    eval_path = resolve_eval_path(path)
    records = read_eval_log(eval_path)
    baseline = next((record for record in records if record.step == 0), records[0])
    rest = [record for record in records if record is not baseline]
    return RunData(
        name=name,
        eval_path=eval_path,
        compute=np.array([record.compute for record in rest], dtype=np.float64),
        pass_rate=np.array([record.pass_rate for record in rest], dtype=np.float64),
        r0=baseline.pass_rate,
    )


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


def fit_run(data: RunData, settings: CurveFitSettings, targets: Sequence[float]) -> RunResult:
    """Fit one run with bootstrap intervals; a FitError becomes the result's error."""
    run_targets = tuple(targets) or ((2.0 * float(data.compute.max()),) if data.compute.size else ())
    try:
        fit = fit_curve(data.compute, data.pass_rate, data.r0, settings)
        intervals = bootstrap_intervals(data.compute, data.pass_rate, data.r0, settings, fit, run_targets)
    except FitError as error:
        return RunResult(data=data, targets=run_targets, error=str(error))
    return RunResult(data=data, targets=run_targets, fit=fit, intervals=intervals)


def _interval_json(interval: Interval) -> list[float]:
    return [interval.low, interval.high]


def run_summary(result: RunResult) -> dict[str, Any]:
    """The JSON object ``fit.json`` holds for one run."""
    summary: dict[str, Any] = {"eval_path": str(result.data.eval_path), "r0": result.data.r0}
    if result.fit is None or result.intervals is None:
        summary["error"] = result.error
        return summary
    fit, intervals = result.fit, result.intervals
    summary.update(
        a=fit.a,
        b=fit.b,
        c_mid=fit.c_mid,
        rmse=fit.rmse,
        sse=fit.sse,
        num_points_used=fit.num_points_used,
        cutoff_compute=fit.cutoff_compute,
        params_at_bounds=list(fit.params_at_bounds),
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
    return summary


def _format_interval(interval: Interval, digits: int) -> str:
    return f"[{interval.low:.{digits}f}, {interval.high:.{digits}f}]"


def _runs_table(results: Sequence[RunResult]) -> Table:
    table = Table(title="Sigmoid fit: R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)")
    for column in ("run", "A", "B", "C_mid", "R0", "points used", "RMSE", "projected pass rate"):
        table.add_column(column, justify="left" if column in ("run", "projected pass rate") else "right")
    for result in results:
        fit, intervals = result.fit, result.intervals
        if fit is None or intervals is None:
            table.add_row(result.data.name, "[red]fit failed[/red]", "", "", f"{result.data.r0:.3f}", "", "",
                          f"[red]{result.error}[/red]")
            continue
        half_width = (intervals.a.high - intervals.a.low) / 2.0
        projections = "\n".join(
            f"{float(fit.predict(target)):.3f} {_format_interval(interval, 3)} @ {target:.4g}"
            for target, interval in zip(intervals.target_compute, intervals.projection)
        )
        table.add_row(
            result.data.name,
            f"{fit.a:.3f} ± {half_width:.3f} {_format_interval(intervals.a, 3)}",
            f"{fit.b:.2f} {_format_interval(intervals.b, 2)}",
            f"{fit.c_mid:.4g}",
            f"{fit.r0:.3f}",
            str(fit.num_points_used),
            f"{fit.rmse:.4f}",
            projections,
        )
    return table


def _comparison_table(rows: Sequence[RunComparison], margin: float) -> Table:
    table = Table(title=f"Recipe comparison (asymptotes within {margin} compared by B at their mean A)")
    for column in ("rank", "run", "A", "B", "shared A", "B at shared A", "decided by"):
        table.add_column(column, justify="left" if column in ("run", "decided by") else "right")
    for row in rows:
        table.add_row(
            str(row.rank),
            row.name,
            f"{row.a:.3f}",
            f"{row.b:.2f}",
            "" if row.shared_a is None else f"{row.shared_a:.3f}",
            "" if row.b_at_shared_a is None else f"{row.b_at_shared_a:.2f}",
            row.decided_by,
        )
    return table


def plot_run(run_dir: Path, run_name: str, settings: CurveFitSettings, targets: Sequence[float] = ()) -> Path:
    """Fit the run in ``run_dir`` and draw ``curve.png`` there (the live fitter's plot).

    A run that cannot be fitted yet is drawn with its points only.
    """
    result = fit_run(load_run(run_dir, run_name), settings, targets)
    return plot_curves(
        [PlotSeries(run_name, result.data.compute, result.data.pass_rate, result.fit, result.intervals)],
        run_dir / PLOT_FILE_NAME,
        target_compute=max(result.targets, default=None),
    )


def main_fit(
    paths: list[Path],
    output_dir: Path | None,
    settings: CurveFitSettings,
    targets: Sequence[float],
    console: Console | None = None,
    margin: float = 0.02,
) -> int:
    """Fit each run's eval log, print the tables, write fit.json and curve.png.

    ``paths`` are eval logs or run directories holding ``eval.jsonl``;
    ``output_dir`` defaults to ./fit-report (a run directory's fit.json
    belongs to the live fitter). ``targets`` are
    compute values to project to (default: twice each run's largest
    compute). With several runs the comparison table is printed and stored
    too. Returns 0 on success, 1 if some run could not be fitted (the others
    are still reported and written), 2 if an input could not be read
    (nothing is written).
    """
    console = console or Console()
    if not paths:
        console.print("[red]fit: no eval logs or run directories given[/red]")
        return EXIT_BAD_INPUT
    if any(not math.isfinite(t) or t <= 0 for t in targets):
        console.print(f"[red]fit: target compute values must be finite and > 0, got {list(targets)}[/red]")
        return EXIT_BAD_INPUT
    try:
        runs = [load_run(path, name) for path, name in zip(paths, _run_names(paths))]
    except (EvalFileError, OSError) as error:
        console.print(f"[red]fit: {error}[/red]")
        return EXIT_BAD_INPUT

    results = [fit_run(data, settings, targets) for data in runs]
    console.print(_runs_table(results))
    fitted = {r.data.name: (r.data.compute, r.data.pass_rate, r.data.r0) for r in results if r.fit is not None}
    comparison: list[RunComparison] = []
    if len(fitted) > 1:
        try:
            comparison = compare_runs(fitted, settings, margin=margin)
        except FitError as error:
            console.print(f"[red]fit: comparison failed: {error}[/red]")
        if comparison:
            console.print(_comparison_table(comparison, margin))

    out = output_dir if output_dir is not None else Path(DEFAULT_OUTPUT_DIR)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "settings": settings.model_dump(),
        "runs": {result.data.name: run_summary(result) for result in results},
        "comparison": [asdict(row) for row in comparison],
    }
    (out / FIT_FILE_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    target_compute = max((t for r in results for t in r.targets), default=None)
    plot_curves(
        [PlotSeries(r.data.name, r.data.compute, r.data.pass_rate, r.fit, r.intervals) for r in results],
        out / PLOT_FILE_NAME,
        target_compute=target_compute,
    )
    console.print(f"wrote {out / FIT_FILE_NAME} and {out / PLOT_FILE_NAME}")
    failed = [r.data.name for r in results if r.fit is None]
    if failed:
        log.warning("fit failed for %s", ", ".join(failed))
        return EXIT_FIT_FAILED
    return EXIT_OK


def main(argv: list[str]) -> int:
    """``asymptote fit``: parse arguments and settings, set up logging, run ``main_fit``.

    Settings come from ``--config`` (YAML/JSON holding CurveFitSettings
    fields) plus ``ASY_FIT__<FIELD>`` environment overrides; a bad value
    raises ConfigError, which the command line turns into exit code 2.
    """
    parser = argparse.ArgumentParser(
        prog="asymptote fit",
        description="Fit R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) to runs' eval.jsonl and project them.",
    )
    parser.add_argument("paths", nargs="+", type=Path, help="eval.jsonl files or run directories holding one")
    parser.add_argument("-o", "--output-dir", type=Path, help=f"where fit.json and curve.png go (default: ./{DEFAULT_OUTPUT_DIR})")
    parser.add_argument(
        "-t", "--target", type=float, action="append", default=[],
        help="compute to project the pass rate to (repeatable; default: twice each run's largest compute)",
    )
    parser.add_argument("--config", type=Path, help="YAML/JSON curve fit settings (env overrides: ASY_FIT__...)")
    parser.add_argument("--margin", type=float, default=0.02, help="asymptotes closer than this are compared by B")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    args = parser.parse_args(argv)
    setup_logging("fit", "text", args.log_level)
    settings = load_config(CurveFitSettings, args.config, "ASY_FIT")
    log_resolved(settings, "fit")
    return main_fit(args.paths, args.output_dir, settings, args.target, margin=args.margin)
