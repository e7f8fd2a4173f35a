"""Seed spread: the embedded default run over several seeds, each fitted as a user's run is.

Owns the figure behind the comparison margin: how far apart the fitted
asymptotes of one recipe land when only the seed changes (``asymptote up
--seed i``: the prompt order, the learner's torch seed and the generators'
sampling seeds; the warm-started model is the same), and whether every run
stayed well: its held-out pass rate never lost more than ``--drop`` from
its best for more than ``--drop-versions`` versions, its truncation rate
stayed at most 5% over every 20 steps, and its first half's fit projected
its end (the half-run verdict). Each run is ``asymptote up`` in
``DIR/seed-<i>``, read back from its ``summary.json``, ``fit.json`` and
``eval.jsonl``; a stopped measurement goes on with the seeds not yet done.

    python -m benchmarks.seeds --output DIR [--seeds 5] [--at-once 1] [--config up.yaml]

Targets: the range (max - min) of the fitted A at most 0.04, over fits that
are all determined; no run losing more than 0.05 for more than 40
versions; truncation at most 5% over any 20 steps; the eval rounds at most
20% of generation with a standard error of at most 0.02 a point. Writes
``seeds_bench.json`` and ``seeds.png``. ``--at-once`` above 1 shares the
machine between runs: their compute axis (FLOPs) is unchanged, their wall
times are not the quiet machine's.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from benchmarks.figure import Figure, Target, write_and_print
from services.local.progress import read_jsonl

console = Console()

BENCH_FILE_NAME = "seeds_bench.json"
SPREAD = Target(of="value", direction="at most", bound=0.04, rule="max - min of the fitted A, every fit determined")
DROP, DROP_VERSIONS = 0.05, 40
TRUNCATION = Target(of="value", direction="at most", bound=0.05)
EVAL_SHARE = Target(of="value", direction="at most", bound=0.20)
EVAL_SE = Target(of="value", direction="at most", bound=0.02)


def run_dir_of(out: Path, seed: int) -> Path:
    return out / f"seed-{seed}"


def completed(run_dir: Path) -> bool:
    summary = run_dir / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("outcome") == "completed"


def start(out: Path, seed: int, config: Path | None) -> subprocess.Popen[bytes]:
    """``asymptote up --seed seed`` into ``out/seed-<seed>`` (a fresh directory), its output in a log beside it."""
    run_dir = run_dir_of(out, seed)
    if run_dir.exists():
        stale = out / f"seed-{seed}.incomplete-{int(time.time())}"
        run_dir.rename(stale)
        console.print(f"seed {seed}: an unfinished run moved to {stale.name}")
    cmd = [sys.executable, "-m", "services.cli", "up", "--seed", str(seed), "--run-dir", str(run_dir)]
    if config is not None:
        cmd += ["--config", str(config)]
    log = (out / f"seed-{seed}.log").open("wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def run_all(out: Path, seeds: list[int], at_once: int, config: Path | None) -> None:
    """Each seed not yet completed, ``at_once`` at a time; a run that fails is reported and left out."""
    todo = [s for s in seeds if not completed(run_dir_of(out, s))]
    running: dict[int, subprocess.Popen[bytes]] = {}
    began = time.monotonic()
    while todo or running:
        while todo and len(running) < at_once:
            seed = todo.pop(0)
            console.print(f"[bold]seed {seed}[/bold] started ({time.monotonic() - began:.0f}s in)")
            running[seed] = start(out, seed, config)
        for seed, proc in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[seed]
            said = "done" if code == 0 else f"FAILED (exit {code}; see seed-{seed}.log)"
            console.print(f"seed {seed} {said} ({time.monotonic() - began:.0f}s in)")
        time.sleep(1.0)


def sustained_loss(versions: list[int], rates: list[float], drop: float) -> tuple[int, float]:
    """(the most versions in a row the pass rate stayed more than ``drop`` below its best so far, the
    deepest fall below that best): a span starts at the first round that far below and ends at the first
    round back within ``drop``, or at the run's last round."""
    best = -math.inf
    longest, deepest = 0, 0.0
    since: int | None = None
    for v, r in zip(versions, rates):
        best = max(best, r)
        deepest = max(deepest, best - r)
        if best - r > drop:
            since = v if since is None else since
            longest = max(longest, v - since)
        else:
            if since is not None:
                longest = max(longest, v - since)
            since = None
    return longest, deepest


def read_run(run_dir: Path, drop: float) -> dict[str, Any]:
    """What one run says of itself, and what this benchmark derives from its eval rounds."""
    summary = json.loads((run_dir / "summary.json").read_text())
    fit = json.loads((run_dir / "fit.json").read_text()) if (run_dir / "fit.json").exists() else {}
    rows = read_jsonl(run_dir / "eval.jsonl")
    versions = [int(r["policy_version"]) for r in rows]
    rates = [float(r["pass_rate"]) for r in rows]
    longest, deepest = sustained_loss(versions, rates, drop)
    flops = summary.get("flops_by_service", {})
    generated = flops.get("generator", 0.0) + flops.get("eval", 0.0)
    held = summary.get("compute_by_service", {})
    held_generated = held.get("generator", 0.0) + held.get("eval", 0.0)
    se = [math.sqrt(r["pass_rate"] * (1 - r["pass_rate"]) / max(1, int(r["num_samples"]))) for r in rows]
    half = summary.get("half_run_projection", {})
    determined = bool(fit.get("determined"))
    points = fit.get("not_determined_point_estimates", {}) if not determined else fit
    return {
        "run_dir": str(run_dir),
        "outcome": summary.get("outcome"),
        "determined": determined,
        "why_not_determined": fit.get("why_not_determined", ""),
        "a": points.get("a"),
        "a_interval": fit.get("a_interval"),
        "b": points.get("b"),
        "c_mid": points.get("c_mid"),
        "c_mid_interval": fit.get("c_mid_interval"),
        "r0": fit.get("r0"),
        "heldout_step0": summary.get("heldout_pass_rate_step0"),
        "heldout_final": summary.get("heldout_pass_rate_final"),
        "heldout_gain": summary.get("heldout_gain"),
        "half_run_verdict": half.get("verdict"),
        "half_run_error": half.get("error"),
        "half_run_interval": half.get("interval"),
        "max_window_truncation_rate": summary.get("length", {}).get("max_window_truncation_rate"),
        "longest_loss_versions": longest,
        "deepest_loss": deepest,
        "eval_share_flops": flops.get("eval", 0.0) / generated if generated else None,
        "eval_share_device_seconds": held.get("eval", 0.0) / held_generated if held_generated else None,
        "max_eval_standard_error": max(se) if se else None,
        "eval_completions_per_round": int(rows[-1]["num_samples"]) if rows else None,
        "lost": summary.get("ledger", {}).get("lost"),
        "trained_twice": summary.get("ledger", {}).get("trained_twice"),
        "total_wall_s": summary.get("total_wall_s"),
        "versions": versions,
        "compute": [float(r["compute"]) for r in rows],
        "pass_rates": rates,
    }


def _rounded(values: list[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 4) for v in values]


def figures(runs: dict[int, dict[str, Any]], drop: float, drop_versions: int) -> list[Figure]:
    """The spread of A, the worst sustained loss, the worst truncation window and the eval rounds' cost."""
    seeds = sorted(runs)
    table = {
        s: {k: v for k, v in runs[s].items() if k not in ("versions", "compute", "pass_rates", "run_dir")}
        for s in seeds
    }
    all_determined = all(runs[s]["determined"] for s in seeds)
    a_values = [runs[s]["a"] for s in seeds if runs[s]["a"] is not None]
    spread = max(a_values) - min(a_values) if len(a_values) == len(seeds) and len(seeds) > 1 else None
    undetermined = [s for s in seeds if not runs[s]["determined"]]
    longest = max(runs[s]["longest_loss_versions"] for s in seeds)
    truncation = [runs[s]["max_window_truncation_rate"] for s in seeds]
    share = [runs[s]["eval_share_flops"] for s in seeds]
    held_share = [runs[s]["eval_share_device_seconds"] for s in seeds]
    se = [runs[s]["max_eval_standard_error"] for s in seeds]
    a_text = ", ".join(f"{runs[s]['a']:.3f}" if runs[s]["a"] is not None else "-" for s in seeds)
    out = [
        Figure(
            name="seed_spread_of_a",
            value=spread if all_determined else None,
            unit="pass rate",
            baseline=f"{len(seeds)} seeds of one recipe",
            measured=(
                f"fitted A {a_text} (seeds {seeds})"
                + (f"; not determined: seeds {undetermined}" if undetermined else "")
                + (f"; range of the point estimates {spread:.3f}" if spread is not None else "")
            ),
            targets=(SPREAD,),
            details={"seeds": table, "range_of_point_estimates": spread},
        ),
        Figure(
            name="seed_longest_sustained_loss",
            value=float(longest),
            unit="versions",
            baseline=f"more than {drop} below the run's best so far",
            measured=f"longest span per seed {[runs[s]['longest_loss_versions'] for s in seeds]}, deepest fall "
            f"{max(runs[s]['deepest_loss'] for s in seeds):.3f}",
            targets=(Target(of="value", direction="at most", bound=drop_versions),),
        ),
        Figure(
            name="seed_max_truncation_over_20_steps",
            value=max((t for t in truncation if t is not None), default=None),
            unit="share",
            baseline="completions cut at max_tokens, per 20 steps",
            measured=f"per seed {_rounded(truncation)}",
            targets=(TRUNCATION,),
        ),
        Figure(
            name="seed_eval_share_of_generation",
            value=max((s for s in share if s is not None), default=None),
            unit="share",
            baseline="eval FLOPs / (train generation + eval) FLOPs",
            measured=f"per seed {_rounded(share)}; by device-seconds held {_rounded(held_share)}",
            targets=(EVAL_SHARE,),
        ),
        Figure(
            name="seed_eval_standard_error",
            value=max((x for x in se if x is not None), default=None),
            unit="pass rate",
            baseline="sqrt(R (1 - R) / completions), the largest of any round",
            measured=f"{runs[seeds[0]]['eval_completions_per_round']} completions a round",
            targets=(EVAL_SE,),
        ),
    ]
    return out


def plot(runs: dict[int, dict[str, Any]], path: Path) -> None:
    """Every seed's eval rounds against compute, with its fitted curve where the fit is determined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from services.fitter.curve import predict

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, seed in enumerate(sorted(runs)):
        run = runs[seed]
        colour = f"C{i}"
        c = np.asarray(run["compute"][1:])
        label = f"seed {seed}: " + (
            f"A {run['a']:.3f} [{run['a_interval']['low']:.3f}, {run['a_interval']['high']:.3f}]"
            if run["determined"]
            else "A not determined"
        )
        ax.plot(c, run["pass_rates"][1:], "o", color=colour, ms=3, alpha=0.7, label=label)
        if run["determined"] and len(c):
            grid = np.geomspace(c[0], c[-1] * 2, 200)
            ax.plot(grid, predict(grid, run["a"], run["b"], run["c_mid"], run["r0"]), color=colour, lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("training compute (FLOPs)")
    ax.set_ylabel("held-out pass rate")
    ax.set_title("one recipe over seeds")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.seeds", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for the runs and {BENCH_FILE_NAME}")
    parser.add_argument("--seeds", type=int, default=5, help="runs, seeds 0 to N-1 (default 5)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--at-once", type=int, default=1, help="runs at the same time (default 1)")
    parser.add_argument("--config", type=Path, help="an up config for every run (default: the embedded default)")
    parser.add_argument("--drop", type=float, default=DROP, help=f"a loss counted from its best (default {DROP})")
    parser.add_argument(
        "--drop-versions", type=int, default=DROP_VERSIONS, help=f"versions a loss may last (default {DROP_VERSIONS})"
    )
    args = parser.parse_args(argv)
    if args.seeds < 2:
        parser.error("--seeds must be at least 2: a spread needs two runs")
    if args.at_once < 1:
        parser.error("--at-once must be at least 1")
    out: Path = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    run_all(out, seeds, args.at_once, args.config)
    runs = {s: read_run(run_dir_of(out, s), args.drop) for s in seeds if completed(run_dir_of(out, s))}
    if len(runs) < 2:
        console.print(f"only {len(runs)} of {len(seeds)} runs completed: no spread to report")
        return 1
    plot(runs, out / "seeds.png")
    write_and_print(figures(runs, args.drop, args.drop_versions), out / BENCH_FILE_NAME)
    return 0 if len(runs) == len(seeds) else 1


if __name__ == "__main__":
    raise SystemExit(main())
