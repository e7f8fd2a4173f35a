"""Learning speed: the local stack against the single-process on-policy loop, decided by fitted curves.

Owns the learning-speed figure: how much sooner the pipeline (generators,
broker and learner as separate processes, PipelineRL-k with in-flight
swaps) reaches a held-out gain than the plain loop (sample with the
transformers model, then one step of the same loss), both on the embedded
default's workload: the shipped word problems, its warm-started model,
batch 16 x 8, max_tokens 96, interruption length control, lr 2e-4 (the
default's when the figure was measured).

Both sides are evaluated the same way: each version's held-out pass rate
over all 200 held-out problems x 4 samples (800 completions, a standard
error of at most 0.018 a point), sampled with the transformers model under
the task's length control (services/embedded/sampling.py). The loop
evaluates in line and leaves that time out of its clock; the stack keeps a
checkpoint every ``--every`` versions, evaluated after the run (its own
eval rounds are cut to the smallest), so neither side's clock pays for
evaluation. The stack's clock starts one median step before its first step
ends (the first batch's generation, as the loop's first step has it; the
generator's engine start is not learning).

Each run's curve is the fitter's sigmoid (services/fitter/curve.py) in
training seconds, with R0 held at the pooled version-0 pass rate of every
run (the same model, the same evaluator); the time to R0 + ``--gain`` is
read from the fit. The ratio is the loop's geometric-mean time over the
stack's, with a 95% interval from Welch's t on the log times (seeds are
the replicates). Runs alternate between the sides so that drift in the
machine meets both.

    python -m benchmarks.learning_speed --output DIR [--seeds 3] [--gain 0.1]

Target: the interval's lower end at least 1.3x. Writes
``learning_speed_bench.json`` and ``learning_speed.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from scipy import stats
from scipy.optimize import isotonic_regression

from benchmarks.figure import Figure, Target, write_and_print
from benchmarks.pipeline import model_dir_of
from services.fitter.curve import CurveFit, CurveFitSettings, FitError, fit_curve
from services.local.progress import read_jsonl

console = Console()

BENCH_FILE_NAME = "learning_speed_bench.json"
NAME = "learning_speed_onpolicy_vs_stack"
TARGET = Target(
    of="ratio", direction="at least", bound=1.3, rule="lower end of the 95% interval of on-policy time / stack time"
)
EVAL_SAMPLES = 4
"""Samples per held-out problem in every evaluation: 200 x 4 = 800 completions."""
BATCH_PROMPTS, GROUP_SIZE, MAX_TOKENS, LR, WARMUP = 16, 8, 96, 2e-4, 10
"""The dials given to both sides: the embedded default's when the figure in docs/benchmarks.md was measured
(its learning rate has since been 1e-4: docs/recipe.md#the-default-run-and-its-spread)."""
STACK_EVAL_SEEDS = 104_729
"""Offset of the stack's evaluation seeds from the loop's (which are seed + 7919 (step + 1)): every
version-0 evaluation pooled into R0 draws its own samples."""
FIT = CurveFitSettings(early_cutoff_compute=0.0, min_num_points=4)
"""Every evaluation counts: the runs are short and start where R0 is measured."""


@dataclass(frozen=True)
class Curve:
    """One run's held-out pass rate against its training seconds."""

    side: str
    seed: int
    seconds: list[float]
    pass_rates: list[float]
    versions: list[int]

    def as_json(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "seed": self.seed,
            "points": [[v, round(t, 2), round(r, 4)] for v, t, r in zip(self.versions, self.seconds, self.pass_rates)],
        }


def words_task_json() -> dict[str, Any]:
    from services.local.workloads import workload_task

    return workload_task("words").model_dump(mode="json")


def run_stack(out: Path, seed: int, steps: int, every: int) -> Path:
    """One ``asymptote up`` of the embedded default in ``out/stack-<seed>``, a checkpoint every ``every``
    versions and all of them kept, eval rounds at their smallest (version 0 and the last, 64 prompts)."""
    run_dir = out / f"stack-{seed}"
    config = out / f"stack-{seed}.json"
    config.write_text(
        json.dumps(
            {
                "max_steps": steps,
                "batch_prompts": BATCH_PROMPTS,
                "group_size": GROUP_SIZE,
                "max_tokens": MAX_TOKENS,
                "lr": LR,
                "warmup_steps": WARMUP,
                "checkpoint_every_steps": every,
                "eval_every_versions": steps,
                "eval_num_samples": 1,
                "services": {
                    "learner": {"keep_checkpoints": steps // every + 2},
                    "broker": {"eval": {"num_prompts": 64}},
                },
            }
        )
    )
    cmd = [sys.executable, "-m", "services.cli", "up", "--run-dir", str(run_dir), "--config", str(config)]
    with (out / f"stack-{seed}.log").open("wb") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise RuntimeError(f"stack run {run_dir} failed (exit {code}); see {out}/stack-{seed}.log")
    return run_dir


def stack_clock(run_dir: Path) -> dict[int, float]:
    """Training seconds at each policy version of a stack run (see the module docstring for the start)."""
    steps = read_jsonl(run_dir / "metrics.jsonl")
    if any(int(s["step"]) != int(s["policy_version"]) for s in steps):
        raise RuntimeError(f"{run_dir}: its learner restarted (versions ran ahead of steps): not a clean run")
    ends = [float(s["unix_s"]) for s in steps]
    step_s = statistics.median(b - a for a, b in itertools.pairwise(ends))
    start = ends[0] - step_s
    return {0: 0.0, **{int(s["policy_version"]): float(s["unix_s"]) - start for s in steps}}


def evaluate_stack(run_dir: Path, model_dir: Path, seed: int, every: int) -> Curve:
    """Every kept checkpoint of a stack run (and its start model) through the loop's evaluator."""
    from asymptote.tasks import DatasetSettings, get_task
    from services.embedded.sampling import length_control_of
    from services.embedded.warmstart import evaluate_pass_rate
    from services.learner.export import export
    from services.learner.model import load_model, load_tokenizer

    task = get_task("dataset", DatasetSettings.model_validate(words_task_json()))
    clock = stack_clock(run_dir)
    versions = [0, *sorted(v for v in clock if v > 0 and v % every == 0)]
    seconds, rates = [], []
    for version in versions:
        source = model_dir
        if version > 0:
            source = run_dir / "exports" / f"v{version}"
            if not source.exists():
                export(run_dir, source, step=version)
        model, tokenizer = load_model(source), load_tokenizer(source)
        rate = evaluate_pass_rate(
            model,
            tokenizer,
            task,
            EVAL_SAMPLES,
            seed=STACK_EVAL_SEEDS + seed + 7919 * (version + 1),
            max_new_tokens=MAX_TOKENS,
            length=length_control_of(task),
        ).pass_rate
        seconds.append(clock[version])
        rates.append(rate)
        console.print(f"  stack seed {seed}: v{version} at {clock[version]:.0f}s: {rate:.3f}")
    return Curve("stack", seed, seconds, rates, versions)


def run_onpolicy(out: Path, model_dir: Path, seed: int, steps: int, every: int, threads: int) -> Curve:
    """The single-process loop on the same model and workload; its clock leaves its evaluations out."""
    metrics = out / f"onpolicy-{seed}.jsonl"
    settings = {
        "task": words_task_json(),
        "num_steps": steps,
        "eval_every_steps": every,
        "eval_samples_per_prompt": EVAL_SAMPLES,
        "num_prompts_per_step": BATCH_PROMPTS,
        "group_size": GROUP_SIZE,
        "max_new_tokens": MAX_TOKENS,
        "lr": LR,
        "warmup_steps": WARMUP,
        "seed": seed,
    }
    cmd = [sys.executable, "-m", "services.embedded.onpolicy", "--model-dir", str(model_dir)]
    cmd += ["--settings", json.dumps(settings), "--metrics", str(metrics), "--threads", str(threads)]
    with (out / f"onpolicy-{seed}.log").open("wb") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise RuntimeError(f"on-policy run {seed} failed (exit {code}); see {out}/onpolicy-{seed}.log")
    evals = [r for r in read_jsonl(metrics) if "eval/pass_rate" in r]
    seconds = [float(r["wall_s"]) - float(r["time/eval_total_s"]) for r in evals]
    rates = [float(r["eval/pass_rate"]) for r in evals]
    for r, t in zip(evals, seconds):
        console.print(f"  on-policy seed {seed}: step {r['step']} at {t:.0f}s: {r['eval/pass_rate']:.3f}")
    return Curve("onpolicy", seed, seconds, rates, [int(r["step"]) for r in evals])


def time_to_gain(fit: CurveFit, gain: float) -> float | None:
    """Seconds at which the fitted curve reaches R0 + ``gain``; None when its asymptote stays below."""
    share = gain / (fit.a - fit.r0) if fit.a > fit.r0 else math.inf
    if share >= 1.0:
        return None
    return float(fit.c_mid * (share / (1.0 - share)) ** (1.0 / fit.b))


def fit_run(curve: Curve, r0: float, gain: float) -> dict[str, Any]:
    """The run's sigmoid in training seconds (version 0 left out: it is R0) and its time to the gain."""
    t = np.array(curve.seconds[1:])
    r = np.array(curve.pass_rates[1:])
    monotone = monotone_time_to_gain(curve, r0, gain)
    try:
        fit = fit_curve(t, r, r0, FIT)
    except FitError as exc:
        return {"fit": None, "error": str(exc), "seconds_to_gain": None, "monotone_seconds_to_gain": monotone}
    return {
        "fit": {"a": fit.a, "b": fit.b, "c_mid": fit.c_mid, "rmse": fit.rmse, "at_bounds": list(fit.params_at_bounds)},
        "seconds_to_gain": time_to_gain(fit, gain),
        "monotone_seconds_to_gain": monotone,
    }


def monotone_time_to_gain(curve: Curve, r0: float, gain: float) -> float | None:
    """The cross-check: where the run's isotonic (never falling) fit, R0 at 0 s and straight between the
    points, first reaches R0 + ``gain``; None when it never does."""
    t = np.array([0.0, *curve.seconds[1:]])
    smooth = isotonic_regression(np.array([r0, *curve.pass_rates[1:]])).x
    above = np.flatnonzero(smooth >= r0 + gain)
    if above.size == 0:
        return None
    i = int(above[0])
    if i == 0:
        return 0.0
    share = (r0 + gain - smooth[i - 1]) / (smooth[i] - smooth[i - 1])
    return float(t[i - 1] + share * (t[i] - t[i - 1]))


def ratio_interval(base: list[float], stack: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Geometric-mean ratio base / stack and its Welch-t interval on the log times."""
    lb, ls = np.log(base), np.log(stack)
    diff = float(lb.mean() - ls.mean())
    vb, vs = float(lb.var(ddof=1)) / len(lb), float(ls.var(ddof=1)) / len(ls)
    se = math.sqrt(vb + vs)
    if se == 0.0:
        return math.exp(diff), math.exp(diff), math.exp(diff)
    dof = (vb + vs) ** 2 / (vb**2 / (len(lb) - 1) + vs**2 / (len(ls) - 1))
    half = float(stats.t.ppf((1 + level) / 2, dof)) * se
    return math.exp(diff), math.exp(diff - half), math.exp(diff + half)


def figure(curves: list[Curve], gain: float) -> tuple[Figure, dict[str, Any]]:
    """The figure from every run's curve (R0 pooled over all of them)."""
    r0 = statistics.fmean(c.pass_rates[0] for c in curves)
    fits = {f"{c.side}-{c.seed}": fit_run(c, r0, gain) for c in curves}
    times = {
        side: [fits[f"{c.side}-{c.seed}"]["seconds_to_gain"] for c in curves if c.side == side]
        for side in ("stack", "onpolicy")
    }
    details: dict[str, Any] = {
        "gain": gain,
        "r0_pooled": r0,
        "r0_standard_error": math.sqrt(r0 * (1 - r0) / (800 * len(curves))),
        "runs": [{**c.as_json(), **fits[f"{c.side}-{c.seed}"]} for c in curves],
    }
    stack_t = [t for t in times["stack"] if t is not None]
    base_t = [t for t in times["onpolicy"] if t is not None]
    missing = {side: sum(t is None for t in ts) for side, ts in times.items()}
    details["runs_without_gain"] = missing
    if len(stack_t) < 2 or len(base_t) < 2:
        return (
            Figure(
                name=NAME,
                value=statistics.fmean(stack_t) if stack_t else None,
                unit="s",
                baseline=f"on-policy times {[round(t) for t in base_t]} s",
                measured=f"stack times {[round(t) for t in stack_t]} s; runs whose fit never gains {gain}: {missing}",
                targets=(TARGET,),
                details=details,
            ),
            fits,
        )
    point, low, high = ratio_interval(base_t, stack_t)
    details.update(ratio=point, interval=[low, high])
    mono = {
        side: [fits[f"{c.side}-{c.seed}"]["monotone_seconds_to_gain"] for c in curves if c.side == side]
        for side in times
    }
    if all(t is not None and t > 0 for ts in mono.values() for t in ts):
        m_point, m_low, m_high = ratio_interval(
            [t for t in mono["onpolicy"] if t is not None], [t for t in mono["stack"] if t is not None]
        )
        details["monotone"] = {"ratio": m_point, "interval": [m_low, m_high]}
    cross_check = ""
    if "monotone" in details:
        m_point, (m_low, m_high) = details["monotone"]["ratio"], details["monotone"]["interval"]
        cross_check = f"; isotonic fits {m_point:.2f}x [{m_low:.2f}, {m_high:.2f}]"
    complete = not any(missing.values())
    if not complete:
        # A run that never gains is no time at all, not a long one: the ratio of the others is shown, and
        # no figure is claimed from it (it leaves out the side's worst run).
        cross_check += (
            f"; of the runs that gained only ({missing['stack']} stack and {missing['onpolicy']} on-policy "
            f"never did): no figure is claimed"
        )
    gm = {side: math.exp(statistics.fmean(math.log(x) for x in ts)) for side, ts in (("s", stack_t), ("o", base_t))}
    return (
        Figure(
            name=NAME,
            value=gm["s"],
            unit="s",
            ratio=low if complete else None,
            baseline=f"single-process on-policy {gm['o']:.1f} s to +{gain} (geometric mean of "
            f"{', '.join(f'{t:.0f}' for t in base_t)} s)",
            measured=f"local stack {gm['s']:.1f} s (of {', '.join(f'{t:.0f}' for t in stack_t)} s): "
            f"{point:.2f}x [{low:.2f}, {high:.2f}] from R0 {r0:.3f}" + cross_check,
            targets=(TARGET,),
            details=details,
        ),
        fits,
    )


def plot(curves: list[Curve], details: dict[str, Any], path: Path) -> None:
    """Every run's points and fitted curve, the two sides in two colours, R0 + gain marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from services.fitter.curve import predict

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {"stack": "tab:blue", "onpolicy": "tab:orange"}
    labels = {"stack": "local stack", "onpolicy": "single-process on-policy"}
    r0, gain = details["r0_pooled"], details["gain"]
    for curve, run in zip(curves, details["runs"]):
        colour = colours[curve.side]
        ax.plot(curve.seconds, curve.pass_rates, "o", color=colour, alpha=0.6, ms=4)
        if run["fit"] is not None:
            t = np.linspace(max(curve.seconds[-1], 1.0) / 200, curve.seconds[-1], 200)
            f = run["fit"]
            ax.plot(t, predict(t, f["a"], f["b"], f["c_mid"], r0), color=colour, label=labels.pop(curve.side, None))
        if run["seconds_to_gain"] is not None:
            ax.axvline(run["seconds_to_gain"], color=colour, lw=0.6, ls=":")
    ax.axhline(r0 + gain, color="grey", lw=0.8, ls="--", label=f"R0 + {gain} (R0 {r0:.3f} pooled)")
    ax.set_xlabel("training seconds (evaluation left out)")
    ax.set_ylabel("held-out pass rate (800 completions)")
    title = "time to the gain"
    if "ratio" in details:
        low, high = details["interval"]
        title = f"on-policy / stack time to +{gain}: {details['ratio']:.2f}x [{low:.2f}, {high:.2f}]"
        missing = details.get("runs_without_gain", {})
        if any(missing.values()):
            title += (
                f"\nfrom the runs that gained only ({missing['stack']} stack, "
                f"{missing['onpolicy']} on-policy never did)"
            )
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(
    out: Path,
    seeds: int = 3,
    gain: float = 0.1,
    stack_steps: int = 240,
    onpolicy_steps: int = 240,
    every: int = 20,
    threads: int = os.cpu_count() or 1,
) -> Figure:
    """Every run not yet in ``out/curves.jsonl`` (a stopped measurement goes on where it stopped), then the
    figure from all of them, and the plot beside it."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    curves_file = out / "curves.jsonl"
    done = {(c["side"], c["seed"]) for c in read_jsonl(curves_file)}
    started = time.monotonic()
    model_dir: Path | None = None
    for seed in range(1, seeds + 1):
        for side in ("stack", "onpolicy"):
            if (side, seed) in done:
                continue
            console.print(f"[bold]{side} seed {seed}[/bold] ({time.monotonic() - started:.0f}s in)")
            if side == "stack":
                run_dir = run_stack(out, seed, stack_steps, every)
                model_dir = model_dir_of(run_dir)
                curve = evaluate_stack(run_dir, model_dir, seed, every)
            else:
                model_dir = model_dir or model_dir_of(out / "stack-1")
                curve = run_onpolicy(out, model_dir, seed, onpolicy_steps, every, threads)
            with curves_file.open("a") as f:
                f.write(json.dumps(asdict(curve)) + "\n")
    curves = [Curve(**c) for c in read_jsonl(curves_file) if c["seed"] <= seeds]
    fig, _ = figure(curves, gain)
    plot(curves, fig.details, out / "learning_speed.png")
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.learning_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for the runs and {BENCH_FILE_NAME}")
    parser.add_argument("--seeds", type=int, default=3, help="runs a side (default 3)")
    parser.add_argument("--gain", type=float, default=0.1, help="held-out gain timed (default 0.1)")
    parser.add_argument("--stack-steps", type=int, default=240, help="learner steps of each stack run (default 240)")
    parser.add_argument("--onpolicy-steps", type=int, default=240, help="steps of each on-policy run (default 240)")
    parser.add_argument("--every", type=int, default=20, help="versions (steps) between evaluations")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the loop's torch threads")
    args = parser.parse_args(argv)
    if args.seeds < 2:
        parser.error("--seeds must be at least 2: the interval needs replicates on each side")
    write_and_print(
        [measure(args.output, args.seeds, args.gain, args.stack_steps, args.onpolicy_steps, args.every, args.threads)],
        args.output / BENCH_FILE_NAME,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
