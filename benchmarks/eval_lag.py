"""How late an eval round is sampled, with and without the generators' eval hold, side by side.

Owns the eval-lag figure. Two runs of the embedded default start at once on
this machine (so the same noise meets both), one with
``services.generator.eval_hold_versions: 0`` (swap at once), one with the
default hold. Each round's lag is its token-weighted sampled version minus
the version it was issued at (``eval.jsonl``); the learner's total wait for
data (``metrics.jsonl``'s ``time/wait_s``) shows whether train steps waited
for eval rounds. ``--runs HOLD NOHOLD`` reads two run directories already
made instead.

    python -m benchmarks.eval_lag --output DIR [--steps 120] [--runs HOLD NOHOLD]

Targets: mean lag with the hold at most 1.0 version; the learner's wait with
the hold at most 1.15x its wait without (the noise of two runs side by side).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.figure import Figure, Target, write_and_print

BENCH_FILE_NAME = "eval_lag_bench.json"
LAG_TARGET = 1.0
WAIT_TARGET = 1.15


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_figures(run_dir: Path) -> dict[str, Any]:
    """A run's lag per round, its mean, and the learner's wait."""
    rounds = read_rows(run_dir / "eval.jsonl")
    lags = [float(e["sampled_version"]) - float(e["policy_version"]) for e in rounds]
    steps = read_rows(run_dir / "metrics.jsonl")
    return {
        "run_dir": str(run_dir),
        "lags": [round(x, 3) for x in lags],
        "mean_lag": statistics.fmean(lags),
        "max_lag": max(lags),
        "wait_s": sum(float(s["time/wait_s"]) for s in steps),
        "steps": len(steps),
    }


def side_by_side(out: Path, steps: int) -> tuple[Path, Path]:
    """Both runs at once, each in ``out``: the hold as configured by default, and none."""
    procs = []
    dirs = {"hold": out / "run-hold", "nohold": out / "run-nohold"}
    for name, run_dir in dirs.items():
        config = out / f"{name}.yaml"
        config.write_text("services:\n  generator:\n    eval_hold_versions: 0\n" if name == "nohold" else "{}\n")
        log = (out / f"{name}.log").open("wb")
        cmd = [sys.executable, "-m", "services.cli", "up", "--run-dir", str(run_dir), "--max-steps", str(steps)]
        procs.append(subprocess.Popen([*cmd, "--config", str(config)], stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"a run failed (exit codes {codes}); see {out}/*.log")
    return dirs["hold"], dirs["nohold"]


def lag_figures(hold_dir: Path, nohold_dir: Path) -> list[Figure]:
    hold, nohold = run_figures(hold_dir), run_figures(nohold_dir)
    lag = Figure(
        name="eval_lag_versions_with_hold",
        value=hold["mean_lag"],
        unit="versions",
        ratio=hold["mean_lag"] / nohold["mean_lag"] if nohold["mean_lag"] > 0 else None,
        baseline=f"without the hold {nohold['mean_lag']:.2f} (rounds {nohold['lags']})",
        measured=f"with the hold {hold['mean_lag']:.2f} (rounds {hold['lags']}), {hold['steps']} steps",
        targets=(Target(of="value", direction="at most", bound=LAG_TARGET),),
        details={"hold": hold, "nohold": nohold},
    )
    wait = Figure(
        name="learner_wait_with_hold_vs_without",
        value=hold["wait_s"],
        unit="s",
        ratio=hold["wait_s"] / nohold["wait_s"] if nohold["wait_s"] > 0 else None,
        baseline=f"without the hold {nohold['wait_s']:.1f} s",
        measured=f"with the hold {hold['wait_s']:.1f} s over {hold['steps']} steps",
        targets=(Target(of="ratio", direction="at most", bound=WAIT_TARGET),),
    )
    return [lag, wait]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.eval_lag", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME} and the runs")
    parser.add_argument("--steps", type=int, default=120, help="learner steps of each run (default 120)")
    parser.add_argument("--runs", nargs=2, type=Path, metavar=("HOLD", "NOHOLD"), help="read these run directories")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    hold, nohold = args.runs if args.runs else side_by_side(args.output, args.steps)
    write_and_print(lag_figures(hold, nohold), args.output / BENCH_FILE_NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
