"""``asymptote bench``: every performance claim as a ratio, measured side by side.

Owns running each benchmark of the project in one invocation and writing
``bench.json`` (the figures, each with ``name``, ``ratio`` or ``seconds``,
``baseline``, ``measured``, ``target`` and ``passed``, plus a machine
description), ``bench.md`` (the same as tables), the scaling sweep's
``scaling.png`` and every run directory it made. Machines are noisy, so each
figure compares against a baseline measured in the same invocation on the
same machine:

  pipeline            in-flight (k = 8) vs synchronous trained samples/s   >= 1.5
  generator           tokens/s inside the RL loop vs the engine alone       >= 0.9
  weight swap         median pause vs one in-memory copy of the weights    <= 2x + 20 ms
  weight transfer     gRPC pull vs reading the bytes from local disk       >= 0.5
  broker              groups/s through the broker vs raw nats-py           >= 0.5 and >= 5,000/s
  learner             service step vs a bare PyTorch step                  <= 1.15
  fitter              1,000-point fit with bootstrap intervals             < 2 s
  learning speed      wall time to +0.3 held-out pass rate, on-policy
                      single process vs the local stack                    >= 1.3

plus a sweep of generator and broker throughput over 1, 2 and 4 generator
processes and over group sizes. ``--quick`` (CI smoke run, under 3 minutes)
runs every benchmark that does not need several local-stack runs at a small
size, one short stack run for the generator and swap figures, and lists the
pipeline, learning-speed and scaling figures as not run.

    asymptote bench --output DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from services.local.bench_pipeline import (
    PAUSE_SLACK_S,
    RATIO_TARGET,
    copy_time_s,
    swap_pauses_s,
    trained_samples_per_s,
)
from services.local.config import StackConfig
from services.local.progress import read_jsonl
from services.local.stack import LocalStack

GENERATOR_TARGET = 0.9
LEARNING_SPEED_TARGET = 1.3
LEARNING_GAIN = 0.3
SCALING_GENERATORS = (1, 2, 4)
SCALING_GROUP_SIZES = (4, 8, 16)

console = Console()


def figure(
    name: str,
    *,
    baseline: str,
    measured: str,
    target: str,
    passed: bool | None,
    ratio: float | None = None,
    seconds: float | None = None,
    **details: Any,
) -> dict[str, Any]:
    """One row of bench.json: exactly one of ``ratio`` and ``seconds`` is set, unless it was not run."""
    row: dict[str, Any] = {"name": name}
    if ratio is not None:
        row["ratio"] = ratio
    if seconds is not None:
        row["seconds"] = seconds
    row.update(baseline=baseline, measured=measured, target=target, passed=passed)
    if details:
        row["details"] = details
    return row


def not_run(name: str, target: str, why: str) -> dict[str, Any]:
    return figure(name, baseline="-", measured=f"not run: {why}", target=target, passed=None)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    versions = {}
    for pkg in ("torch", "vllm", "nats", "grpc"):
        try:
            versions[pkg] = __import__(pkg).__version__
        except Exception:
            versions[pkg] = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "gpu": None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "packages": versions,
    }


# -- local-stack runs with their Prometheus metrics sampled over time --------


class Scraper(threading.Thread):
    """Samples the generators' and the broker's /metrics once a second during a stack run."""

    COUNTERS = ("asymptote_generator_tokens", "asymptote_broker_groups_received")

    def __init__(self, stack: LocalStack, interval_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.stack = stack
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        while not self._halt.wait(self.interval_s):
            ports = {
                name: http
                for name, (_, http) in dict(getattr(self.stack, "ports", {})).items()
                if name.startswith(("generator", "broker"))
            }
            totals = dict.fromkeys(self.COUNTERS, 0.0)
            seen = 0
            for port in ports.values():
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1.0) as r:
                        text = r.read().decode()
                except OSError:
                    continue
                seen += 1
                for family in text_string_to_metric_families(text):
                    if family.name in totals:
                        totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
            if seen == len(ports) and ports:
                self.samples.append((time.time(), totals))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5.0)

    def rate(self, counter: str, t_from: float, t_to: float) -> float | None:
        """Increase per second of ``counter`` between the samples nearest ``t_from`` and ``t_to``."""
        inside = [(t, v[counter]) for t, v in self.samples if t_from <= t <= t_to]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


@dataclass
class StackRun:
    run_dir: Path
    model_dir: Path
    config: StackConfig
    scraper: Scraper
    steps: list[dict[str, Any]] = field(default_factory=list)

    def window(self, skip_fraction: float = 0.2) -> tuple[float, float]:
        """Unix times of the steady part of the run: after the first ``skip_fraction`` of the steps."""
        first = self.steps[min(len(self.steps) - 2, max(1, int(len(self.steps) * skip_fraction)))]
        return first["unix_s"], self.steps[-1]["unix_s"]

    def rate(self, counter: str) -> float | None:
        return self.scraper.rate(counter, *self.window())


def run_stack(
    out: Path, name: str, until: Callable[[dict[str, Any]], bool] | None = None, **overrides: Any
) -> StackRun:
    """One local-stack run in ``out/name`` (generators pinned apart from the learner)."""
    config = StackConfig.model_validate({"run_dir": out / name, "pin_cores": True, **overrides})
    stack = LocalStack(config)
    scraper = Scraper(stack)
    scraper.start()
    try:
        code = stack.run(until)
    finally:
        scraper.stop()
    if code != 0:
        raise RuntimeError(f"stack run {name} failed (exit {code}); see {stack.run_dir / 'logs'}")
    import yaml

    model_dir = Path(yaml.safe_load((stack.run_dir / "config" / "learner.yaml").read_text())["model_dir"])
    return StackRun(stack.run_dir, model_dir, config, scraper, read_jsonl(stack.run_dir / "metrics.jsonl"))


def pinned(role: str) -> Callable[[], None] | None:
    """preexec_fn pinning a child process to the cores the local stack gives ``role``."""
    cores = os.cpu_count() or 1
    if cores < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = set(range(cores - 1)) if role == "generator" else {cores - 1}
    return lambda: os.sched_setaffinity(0, cpus)


def run_module(module: str, args: list[str], role: str, timeout_s: float = 900.0) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        preexec_fn=pinned(role),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{module} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


# -- the figures ---------------------------------------------------------------


def learner_figure(quick: bool) -> dict[str, Any]:
    import torch

    from services.learner.bench import TARGET, bench_learner_step

    torch.set_num_threads(1)
    r = bench_learner_step(repeats=8 if quick else 30)
    return figure(
        "learner_step_service_vs_bare",
        ratio=r["ratio"],
        baseline=f"bare PyTorch step {r['bare_step_s'] * 1e3:.1f} ms",
        measured=f"service step {r['service_step_s'] * 1e3:.1f} ms ({r['samples_per_step']} samples)",
        target=f"<= {TARGET}",
        passed=r["passed"],
        repeats=r["repeats"],
    )


def fitter_figure(quick: bool) -> dict[str, Any]:
    from services.fitter.bench import bench_fitter

    r = bench_fitter(quick)
    return figure(
        "fitter_fit_and_bootstrap_1000_points",
        seconds=r["seconds"],
        baseline=f"node-by-node scalar grid ~{r['scalar_grid_s_extrapolated']:.1f} s",
        measured=f"fit {r['fit_s']:.3f} s + bootstrap {r['bootstrap_s']:.3f} s ({r['num_bootstrap_resamples']} "
        f"resamples), median of {r['repeats']}",
        target=f"< {r['target']} s",
        passed=r["passed"],
    )


def transfer_figure(quick: bool, out: Path) -> dict[str, Any]:
    from services.local.bench_transfer import bench_transfer

    return _as_figure(bench_transfer(quick=quick, workdir=out / "transfer"))


def broker_figure(quick: bool, out: Path) -> dict[str, Any]:
    from services.broker.bench import bench_broker

    return _as_figure(bench_broker(quick=quick, workdir=out / "broker"))


def _as_figure(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("name", "ratio", "seconds", "baseline", "measured", "target", "passed")
    details = {k: v for k, v in result.items() if k not in keys}
    return figure(
        result["name"],
        ratio=result.get("ratio"),
        seconds=result.get("seconds"),
        baseline=str(result["baseline"]),
        measured=str(result["measured"]),
        target=str(result["target"]),
        passed=bool(result["passed"]),
        **details,
    )


def standalone_generator(run: StackRun, out: Path, window_s: float) -> dict[str, Any]:
    """The same engine, prompts, group size, budget and concurrency as the run's generator, alone."""
    import yaml

    gen_cfg = yaml.safe_load((run.run_dir / "config" / "generator-0.yaml").read_text())
    result = out / "generator_standalone.json"
    run_module(
        "services.generator.bench",
        [
            "--model-dir",
            str(run.model_dir),
            "--output",
            str(result),
            "--window-s",
            str(window_s),
            "--group-size",
            str(run.config.group_size),
            "--max-tokens",
            str(run.config.max_tokens),
            "--concurrency",
            str(gen_cfg.get("max_inflight_groups", 32)),
            "--max-num-seqs",
            str(gen_cfg["engine"]["max_num_seqs"]),
            "--task",
            json.dumps(run.config.task.model_dump(mode="json")),
        ],
        role="generator",
    )
    return json.loads(result.read_text())


def generator_figure(run: StackRun, standalone: dict[str, Any]) -> dict[str, Any]:
    in_loop = run.rate("asymptote_generator_tokens")
    if in_loop is None:
        raise RuntimeError(f"{run.run_dir}: too few metric samples for the generator's in-loop rate")
    ratio = in_loop / standalone["tokens_per_s"]
    return figure(
        "generator_tokens_per_s_in_loop_vs_standalone",
        ratio=ratio,
        baseline=f"engine alone {standalone['tokens_per_s']:.0f} tokens/s (median of "
        f"{len(standalone['window_tokens_per_s'])} windows of {standalone['window_s']:.0f} s, "
        f"{standalone['concurrency_groups']} groups in flight)",
        measured=f"in the RL loop {in_loop:.0f} tokens/s (steady part of {len(run.steps)} steps)",
        target=f">= {GENERATOR_TARGET}",
        passed=ratio >= GENERATOR_TARGET,
    )


def swap_figure(run: StackRun) -> dict[str, Any]:
    pauses = swap_pauses_s(run.run_dir)
    copy_s, num_bytes = copy_time_s(run.model_dir)
    if not pauses:
        raise RuntimeError(f"{run.run_dir}: no weight swap was logged")
    median = statistics.median(pauses)
    bound = 2 * copy_s + PAUSE_SLACK_S
    p90 = statistics.quantiles(pauses, n=10)[-1] if len(pauses) >= 2 else pauses[0]
    return figure(
        "swap_pause_median_vs_memory_copy",
        seconds=median,
        baseline=f"copy of {num_bytes:,} bytes in memory {copy_s * 1e3:.3f} ms",
        measured=f"median of {len(pauses)} swaps {median * 1e3:.1f} ms (p90 {p90 * 1e3:.1f} ms)",
        target=f"<= 2 x copy + 20 ms = {bound * 1e3:.1f} ms",
        passed=median <= bound,
    )


def pipeline_figure(inflight: StackRun, sync: StackRun) -> dict[str, Any]:
    a, s = trained_samples_per_s(inflight.run_dir), trained_samples_per_s(sync.run_dir)
    ratio = a / s
    return figure(
        "pipeline_samples_per_s_inflight_vs_sync",
        ratio=ratio,
        baseline=f"synchronous {s:.1f} samples/s",
        measured=f"in-flight k=8 {a:.1f} samples/s",
        target=f">= {RATIO_TARGET}",
        passed=ratio >= RATIO_TARGET,
        steps=len(inflight.steps),
    )


def gain_reached(gain: float) -> Callable[[dict[str, Any]], bool]:
    def until(snap: dict[str, Any]) -> bool:
        evals = snap["evals"]
        r0 = next((e["pass_rate"] for e in evals if e["policy_version"] == 0), None)
        return r0 is not None and any(e["pass_rate"] - r0 >= gain for e in evals)

    return until


def stack_time_to_gain(run: StackRun, gain: float) -> tuple[float | None, dict[str, Any]]:
    """Seconds from the first trained step to the step whose weights first score R0 + gain."""
    evals = read_jsonl(run.run_dir / "eval.jsonl")
    r0 = next(e["pass_rate"] for e in evals if e["policy_version"] == 0)
    hit = next((e for e in evals if e["pass_rate"] - r0 >= gain), None)
    info = {"r0": r0, "evals": [(e["policy_version"], round(e["pass_rate"], 4)) for e in evals]}
    if hit is None:
        return None, info
    at = {s["policy_version"]: s["unix_s"] for s in run.steps}
    info.update(version=hit["policy_version"], pass_rate=hit["pass_rate"])
    return at[hit["policy_version"]] - run.steps[0]["unix_s"], info


def onpolicy_time_to_gain(
    run: StackRun, out: Path, gain: float, eval_every: int
) -> tuple[float | None, dict[str, Any]]:
    """Seconds of training (evaluations excluded) for the single-process loop to reach R0 + gain."""
    metrics = out / "onpolicy.jsonl"
    c = run.config
    settings = {
        "task": c.task.model_dump(mode="json"),
        "num_steps": 3000,
        "target_gain": gain,
        "eval_every_steps": eval_every,
        "num_prompts_per_step": c.batch_prompts,
        "group_size": c.group_size,
        "max_new_tokens": c.max_tokens,
        "lr": c.lr,
        "warmup_steps": c.warmup_steps,
        "eval_samples_per_prompt": c.eval_num_samples,
        "max_wall_s": 1200,
    }
    run_module(
        "services.learner.onpolicy",
        [
            "--model-dir",
            str(run.model_dir),
            "--settings",
            json.dumps(settings),
            "--metrics",
            str(metrics),
        ],
        role="learner",
        timeout_s=1500,
    )
    records = read_jsonl(metrics)
    r0 = records[0]["eval/pass_rate"]
    hit = next((r for r in records[1:] if "eval/pass_rate" in r and r["eval/pass_rate"] - r0 >= gain), None)
    info = {"r0": r0, "evals": [(r["step"], round(r["eval/pass_rate"], 4)) for r in records if "eval/pass_rate" in r]}
    if hit is None:
        return None, info
    info.update(step=hit["step"], pass_rate=hit["eval/pass_rate"])
    return hit["wall_s"] - hit["time/eval_total_s"], info


def learning_speed_figure(out: Path, gain: float = LEARNING_GAIN, eval_every: int = 20) -> dict[str, Any]:
    run = run_stack(out, "learning", until=gain_reached(gain), eval_every_versions=eval_every)
    stack_s, stack_info = stack_time_to_gain(run, gain)
    base_s, base_info = onpolicy_time_to_gain(run, out, gain, eval_every)
    target = f"stack >= {LEARNING_SPEED_TARGET}x faster"
    if stack_s is None or base_s is None:
        missing = "the local stack" if stack_s is None else "the on-policy loop"
        return figure(
            f"learning_speed_plus_{gain}_onpolicy_vs_stack",
            baseline=f"on-policy {base_s} s",
            measured=f"stack {stack_s} s; {missing} never gained {gain}",
            target=target,
            passed=False,
            stack=stack_info,
            onpolicy=base_info,
        )
    ratio = base_s / stack_s
    return figure(
        f"learning_speed_plus_{gain}_onpolicy_vs_stack",
        ratio=ratio,
        baseline=f"single-process on-policy {base_s:.1f} s (step {base_info['step']}, "
        f"{base_info['r0']:.3f} -> {base_info['pass_rate']:.3f})",
        measured=f"local stack {stack_s:.1f} s (version {stack_info['version']}, "
        f"{stack_info['r0']:.3f} -> {stack_info['pass_rate']:.3f})",
        target=target,
        passed=ratio >= LEARNING_SPEED_TARGET,
        stack=stack_info,
        onpolicy=base_info,
    )


def scaling_row(run: StackRun, generators: int, group_size: int) -> dict[str, Any]:
    tokens = run.rate("asymptote_generator_tokens")
    groups = run.rate("asymptote_broker_groups_received")
    return {
        "generators": generators,
        "group_size": group_size,
        "generator_tokens_per_s": tokens,
        "tokens_per_s_per_generator": tokens / generators if tokens is not None else None,
        "broker_groups_per_s": groups,
        "trained_samples_per_s": trained_samples_per_s(run.run_dir),
        "steps": len(run.steps),
    }


def scaling_sweep(out: Path, steps: int, base: StackRun | None) -> list[dict[str, Any]]:
    rows = []
    points = [(n, 8) for n in SCALING_GENERATORS] + [(1, g) for g in SCALING_GROUP_SIZES if g != 8]
    for n, g in points:
        if base is not None and (n, g) == (1, base.config.group_size) and base.config.num_generators == 1:
            rows.append(scaling_row(base, n, g))
            continue
        console.print(f"[bold]scaling: {n} generator(s), group size {g}[/bold]")
        run = run_stack(
            out, f"scaling-g{n}-G{g}", num_generators=n, group_size=g, max_steps=steps, eval_every_versions=steps
        )
        rows.append(scaling_row(run, n, g))
    return rows


def plot_scaling(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, fixed, label in (
        (axes[0], "generators", ("group_size", 8), "generator processes (group size 8)"),
        (axes[1], "group_size", ("generators", 1), "group size (1 generator)"),
    ):
        sel = sorted((r for r in rows if r[fixed[0]] == fixed[1]), key=lambda r: r[key])
        xs = [r[key] for r in sel]
        ax.plot(xs, [r["generator_tokens_per_s"] or 0 for r in sel], "o-", color="tab:blue", label="generator tokens/s")
        ax.set_xlabel(label)
        ax.set_ylabel("generated tokens/s", color="tab:blue")
        ax.set_xticks(xs)
        twin = ax.twinx()
        twin.plot(xs, [r["broker_groups_per_s"] or 0 for r in sel], "s--", color="tab:orange")
        twin.set_ylabel("broker groups/s", color="tab:orange")
    fig.suptitle(f"Throughput scaling on this machine ({os.cpu_count()} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the report ------------------------------------------------------------------


def _value(fig: dict[str, Any]) -> str:
    if "ratio" in fig:
        return f"{fig['ratio']:.2f}x"
    if "seconds" in fig:
        return f"{fig['seconds'] * 1e3:.1f} ms" if fig["seconds"] < 1 else f"{fig['seconds']:.2f} s"
    return "-"


def _verdict(fig: dict[str, Any]) -> str:
    return {True: "met", False: "MISSED", None: "not run"}[fig["passed"]]


def write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    lines = [
        f"# Asymptote benchmarks ({report['mode']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, no GPU; Python {m['python']}, "
        f"torch {m['packages'].get('torch')}, vLLM {m['packages'].get('vllm')}. Wall time {report['wall_s']:.0f} s.",
        "",
        "| figure | value | baseline | measured | target | result |",
        "|---|---|---|---|---|---|",
    ]
    for f in report["figures"]:
        lines.append(
            f"| {f['name']} | {_value(f)} | {f['baseline']} | {f['measured']} | {f['target']} | {_verdict(f)} |"
        )
    if report.get("scaling"):
        lines += [
            "",
            "## Scaling",
            "",
            "| generators | group size | generator tokens/s | per generator | broker groups/s | trained samples/s |",
            "|---|---|---|---|---|---|",
        ]
        for r in report["scaling"]:
            lines.append(
                f"| {r['generators']} | {r['group_size']} | {_num(r['generator_tokens_per_s'])} | "
                f"{_num(r['tokens_per_s_per_generator'])} | {_num(r['broker_groups_per_s'])} | "
                f"{_num(r['trained_samples_per_s'])} |"
            )
        lines += ["", "![scaling](scaling.png)"]
    (out / "bench.md").write_text("\n".join(lines) + "\n")


def _num(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:,.0f}"


def run_all(out: Path, quick: bool) -> dict[str, Any]:
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "machine": machine(),
        "figures": [],
        "scaling": [],
        "errors": [],
    }
    steps = 8 if quick else 60

    def section(title: str, body: Callable[[], list[dict[str, Any]]]) -> None:
        t0 = time.monotonic()
        console.print(f"[bold cyan]== {title}[/bold cyan]")
        try:
            figs = body()
        except Exception as exc:
            report["errors"].append({"section": title, "error": f"{type(exc).__name__}: {exc}"})
            console.print(f"[red]{escape(title)} failed: {escape(str(exc))}[/red]")
            return
        for f in figs:
            report["figures"].append(f)
            console.print(escape(f"  {f['name']}: {_value(f)}  target {f['target']}  -> {_verdict(f)}"))
        console.print(f"  ({time.monotonic() - t0:.0f} s)")

    section("learner step", lambda: [learner_figure(quick)])
    section("fitter", lambda: [fitter_figure(quick)])
    section("weight transfer", lambda: [transfer_figure(quick, out)])
    section("broker", lambda: [broker_figure(quick, out)])
    runs: dict[str, StackRun] = {}

    def stack_figures() -> list[dict[str, Any]]:
        runs["inflight"] = run_stack(out, "pipeline-inflight", mode="async", max_steps=steps, eval_every_versions=steps)
        standalone = standalone_generator(runs["inflight"], out, window_s=3.0 if quick else 8.0)
        figs = [generator_figure(runs["inflight"], standalone), swap_figure(runs["inflight"])]
        if quick:
            return [not_run("pipeline_samples_per_s_inflight_vs_sync", f">= {RATIO_TARGET}", "full mode only"), *figs]
        runs["sync"] = run_stack(out, "pipeline-sync", mode="sync", max_steps=steps, eval_every_versions=steps)
        return [pipeline_figure(runs["inflight"], runs["sync"]), *figs]

    section("pipeline, generator efficiency and weight swaps (local stack)", stack_figures)
    name = f"learning_speed_plus_{LEARNING_GAIN}_onpolicy_vs_stack"
    if quick:
        report["figures"].append(not_run(name, f"stack >= {LEARNING_SPEED_TARGET}x faster", "full mode only"))
    else:
        section("learning speed (local stack vs single-process on-policy)", lambda: [learning_speed_figure(out)])

        def sweep() -> list[dict[str, Any]]:
            report["scaling"] = scaling_sweep(out, 20, runs.get("inflight"))
            plot_scaling(report["scaling"], out / "scaling.png")
            return []

        section("scaling sweep", sweep)
    report["wall_s"] = time.monotonic() - started
    write_report(out, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asymptote bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="directory for bench.json, bench.md and the runs")
    parser.add_argument("--quick", action="store_true", help="CI smoke run (under 3 minutes)")
    args = parser.parse_args(argv)
    report = run_all(args.output.resolve(), args.quick)
    print((args.output / "bench.md").read_text())
    missed = [f["name"] for f in report["figures"] if f["passed"] is False]
    if report["errors"]:
        console.print(f"[red]{len(report['errors'])} benchmark(s) failed to run[/red]")
        return 1
    console.print(
        f"{len(report['figures']) - len(missed)} of {len(report['figures'])} figures met or not run; "
        f"missed: {', '.join(missed) or 'none'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
