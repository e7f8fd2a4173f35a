"""``asymptote bench``: every performance claim as a figure against a baseline, measured side by side.

Owns running each benchmark of the project in one invocation and writing
``bench.json`` (one :class:`benchmarks.figure.Figure` record per figure plus
a machine description), ``bench.md`` (the same as tables), the scaling
sweep's ``scaling.png`` and every run directory it made. Machines are noisy,
so each figure compares against a baseline measured in the same invocation
on the same machine:

  pipeline            in-flight (k = 8) vs synchronous trained samples/s   >= 1.5
  generator           tokens/s inside the RL loop vs the engine alone       >= 0.9
  weight swap         median pause vs one in-memory copy of the weights    <= 2x + 20 ms
  weight transfer     gRPC pull vs reading the bytes from local disk       >= 0.5
  broker              groups/s through the broker vs raw nats-py           >= 0.5 and >= 5,000/s
  learner             service step vs a bare PyTorch step                  <= 1.15
  learner memory      per-rank tensor bytes, two FSDP2 ranks vs one rank   <= 0.65
                      (with and without activation checkpointing; peak
                      RSS beside it), FSDP2 vs DDP step time on the CPU    >= 1
  fitter              1,000-point fit with bootstrap intervals             < 2 s
  sweep               500 simulated sweeps of 8 arms decided by the sweep  wrong eliminations <= 0.05,
                      rule, beside SuccessiveHalving at its rungs          chosen within 0.02 >= 95%,
                                                                           compute <= 50%
  learning speed      training time to +0.1 held-out pass rate (word       >= 1.3
                      problems), on-policy single process vs the local     (interval's
                      stack, read from fitted curves of 3 runs a side      lower end)

plus a sweep of generator and broker throughput over 1, 2 and 4 generator
processes and over group sizes. ``--quick`` (CI smoke run) runs every
benchmark that does not need several local-stack runs or a second engine at a
small size, one short stack run for the swap figure, and lists the pipeline,
generator-efficiency, learning-speed and scaling figures as not run.

A stack run whose metrics give an in-loop rate runs at least its number of
steps and on until its steady part holds ``RATE_SAMPLES`` samples of the
services' counters, so a fast machine cannot finish it before there is
anything to measure; ``DEADLINE_STEPS_FACTOR`` times its steps bounds it.

    asymptote bench --output DIR [--quick]
    asymptote bench --output DIR --scale     # the data plane at scale (benchmarks.scale) alone
"""

from __future__ import annotations

import json
import math
import os
import platform
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

from asymptote.cli_args import ArgumentParser
from asymptote.errors import ConfigError
from asymptote.lifecycle import die_with_parent, interrupt_on_sigterm
from benchmarks import learning_speed
from benchmarks.figure import Figure, Target, not_run, quantity
from benchmarks.pipeline import (
    PIPELINE_TARGETS,
    THROUGHPUT_WORKLOAD,
    model_dir_of,
    pipeline_figure,
    swap_figure,
    trained_samples_per_s,
)
from services.local.config import StackConfig
from services.local.progress import read_jsonl
from services.local.stack import INTERRUPTED, LocalStack

GENERATOR_FIGURE = "generator_tokens_per_s_in_loop_vs_standalone"
GENERATOR_TARGETS = (Target(of="ratio", direction="at least", bound=0.9),)
SCALING_GENERATORS = (1, 2, 4)
SCALING_GROUP_SIZES = (4, 8, 16)
RATE_SAMPLES = 5
"""Metric samples the steady part of a measured stack run must hold before it may stop."""
DEADLINE_STEPS_FACTOR = 10
"""A measured stack run stops at this many times its steps even without ``RATE_SAMPLES``."""

console = Console()


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

    def count(self, t_from: float, t_to: float) -> int:
        """Samples taken between ``t_from`` and ``t_to`` (Unix seconds)."""
        return sum(t_from <= t <= t_to for t, _ in list(self.samples))

    def rate(self, counter: str, t_from: float, t_to: float) -> float | None:
        """Increase per second of ``counter`` between the samples nearest ``t_from`` and ``t_to``."""
        inside = [(t, v[counter]) for t, v in self.samples if t_from <= t <= t_to]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def steady_window(steps: list[dict[str, Any]], skip_fraction: float = 0.2) -> tuple[float, float]:
    """Unix times of the steady part of a run's learner steps: after the first ``skip_fraction`` of them."""
    first = steps[min(len(steps) - 2, max(1, int(len(steps) * skip_fraction)))]
    return first["unix_s"], steps[-1]["unix_s"]


@dataclass
class StackRun:
    run_dir: Path
    model_dir: Path
    config: StackConfig
    scraper: Scraper
    steps: list[dict[str, Any]] = field(default_factory=list)

    def rate(self, counter: str) -> float | None:
        return self.scraper.rate(counter, *steady_window(self.steps))


Until = Callable[[dict[str, Any], Scraper], bool]
"""Whether a stack run may stop, from its progress snapshot and its metric samples so far."""


def run_stack(out: Path, name: str, until: Until | None = None, **overrides: Any) -> StackRun:
    """One local-stack run in ``out/name`` (generators pinned apart from the learner)."""
    config = StackConfig.model_validate(
        {"run_dir": out / name, "pin_cores": True, "workload": THROUGHPUT_WORKLOAD, **overrides}
    )
    stack = LocalStack(config)
    scraper = Scraper(stack)
    scraper.start()
    try:
        code = stack.run(None if until is None else lambda snap: until(snap, scraper))
    finally:
        scraper.stop()
    if code == INTERRUPTED:
        raise KeyboardInterrupt  # not a failed section: the whole bench stops (its stack already has)
    if code != 0:
        raise RuntimeError(f"stack run {name} failed (exit {code}); see {stack.run_dir / 'logs'}")
    return StackRun(
        stack.run_dir, model_dir_of(stack.run_dir), config, scraper, read_jsonl(stack.run_dir / "metrics.jsonl")
    )


def rates_measurable(scraper: Scraper, metrics: Path, min_steps: int) -> bool:
    """Whether a run has ``min_steps`` learner steps in ``metrics`` (its metrics.jsonl) and the steady
    part of them holds ``RATE_SAMPLES`` of ``scraper``'s samples."""
    rows = read_jsonl(metrics)
    return len(rows) >= max(2, min_steps) and scraper.count(*steady_window(rows)) >= RATE_SAMPLES


def measured_run(out: Path, name: str, steps: int, **overrides: Any) -> StackRun:
    """A stack run of at least ``steps`` learner steps that goes on until its rates can be measured.

    It stops at the first progress poll where :func:`rates_measurable`, or at
    ``DEADLINE_STEPS_FACTOR * steps`` steps (then its rates may be None).
    """
    deadline_steps = DEADLINE_STEPS_FACTOR * steps

    def until(snap: dict[str, Any], scraper: Scraper) -> bool:
        return snap["step"] >= steps and rates_measurable(scraper, out / name / "metrics.jsonl", steps)

    return run_stack(out, name, until, max_steps=deadline_steps, eval_every_versions=deadline_steps, **overrides)


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
        preexec_fn=die_with_parent(pinned(role)),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{module} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


# -- the figures ---------------------------------------------------------------


def learner_figure(quick: bool) -> Figure:
    import torch

    from benchmarks.learner import bench_learner_step

    torch.set_num_threads(1)
    return bench_learner_step(repeats=8 if quick else 30)


def serving_figure(quick: bool, out: Path) -> Figure:
    from benchmarks.serving import bench_serving

    return bench_serving(quick, out / "serving")


def learner_memory_figures(quick: bool, out: Path) -> list[Figure]:
    from benchmarks.learner_memory import bench_learner_memory

    return bench_learner_memory(quick=quick, workdir=out / "learner_memory")


def fitter_figure(quick: bool) -> Figure:
    from benchmarks.fitter import bench_fitter

    return bench_fitter(quick)


def sweep_figures() -> list[Figure]:
    from benchmarks.sweep import NUM_SWEEPS, bench_sweep

    return bench_sweep(NUM_SWEEPS)


def sweep_figure_names() -> list[tuple[str, str, tuple[Target, ...]]]:
    from benchmarks.sweep import FIGURE_TARGETS

    return list(FIGURE_TARGETS)


def transfer_figures(quick: bool, out: Path) -> list[Figure]:
    from benchmarks.transfer import bench_digest, bench_transfer

    return [*bench_transfer(quick=quick, workdir=out / "transfer"), bench_digest(quick)]


def broker_figure(quick: bool, out: Path) -> Figure:
    from benchmarks.broker import bench_broker

    return bench_broker(quick=quick, workdir=out / "broker")


def standalone_generator(run: StackRun, out: Path, window_s: float) -> dict[str, Any]:
    """The same engine, prompts, group size, budget and concurrency as the run's generator, alone."""
    import yaml

    gen_cfg = yaml.safe_load((run.run_dir / "config" / "generator-0.yaml").read_text())
    result = out / "generator_standalone.json"
    run_module(
        "benchmarks.generator",
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


def generator_figure(run: StackRun, standalone: dict[str, Any]) -> Figure:
    in_loop = run.rate("asymptote_generator_tokens")
    if in_loop is None:
        raise RuntimeError(
            f"{run.run_dir}: fewer than two metric samples in the steady part of its {len(run.steps)} steps "
            f"(at most {run.config.max_steps})"
        )
    return Figure(
        name=GENERATOR_FIGURE,
        value=in_loop,
        unit="tokens/s",
        ratio=in_loop / standalone["tokens_per_s"],
        baseline=f"engine alone {standalone['tokens_per_s']:.0f} tokens/s (median of "
        f"{len(standalone['window_tokens_per_s'])} windows of {standalone['window_s']:.0f} s, "
        f"{standalone['concurrency_groups']} groups in flight)",
        measured=f"in the RL loop {in_loop:.0f} tokens/s (steady part of {len(run.steps)} steps)",
        targets=GENERATOR_TARGETS,
        details={"standalone": standalone},
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
        if base is not None and (n, g) == (1, base.config.group_size) and (base.config.num_generators or 1) == 1:
            rows.append(scaling_row(base, n, g))
            continue
        console.print(f"[bold]scaling: {n} generator(s), group size {g}[/bold]")
        run = measured_run(out, f"scaling-g{n}-G{g}", steps, num_generators=n, group_size=g)
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


def write_report(out: Path, report: dict[str, Any], figures: list[Figure]) -> None:
    """bench.json (``report`` with every figure's record) and bench.md (the same as tables)."""
    (out / "bench.json").write_text(json.dumps({**report, "figures": [f.as_json() for f in figures]}, indent=2) + "\n")
    m = report["machine"]
    lines = [
        f"# Asymptote benchmarks ({report['mode']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, no GPU; Python {m['python']}, "
        f"torch {m['packages'].get('torch')}, vLLM {m['packages'].get('vllm')}. Wall time {report['wall_s']:.0f} s.",
        "",
        "| figure | value | ratio | baseline | measured | target | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        lines.append(
            f"| {f.name} | {quantity(f.value, f.unit)} | {quantity(f.ratio, 'x')} | {f.baseline} | {f.measured} "
            f"| {f.target} | {f.verdict} |"
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


SECTIONS = ("learner", "memory", "fitter", "sweep", "transfer", "broker", "stack", "learning", "scaling")
"""The benchmark's sections, in the order they run (``--only`` picks one)."""


def run_all(out: Path, quick: bool, only: str | None = None) -> tuple[dict[str, Any], list[Figure]]:
    """Every benchmark (or the section ``only``) into ``out``; the report (machine, mode, scaling, errors)
    and the figures."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"mode": "quick" if quick else "full", "machine": machine(), "scaling": [], "errors": []}
    figures: list[Figure] = []
    steps = 8 if quick else 60

    def section(key: str, title: str, body: Callable[[], list[Figure]]) -> None:
        if only is not None and key != only:
            return
        t0 = time.monotonic()
        console.print(f"[bold cyan]== {title}[/bold cyan]")
        try:
            made = body()
        except Exception as exc:
            report["errors"].append({"section": title, "error": f"{type(exc).__name__}: {exc}"})
            console.print(f"[red]{escape(title)} failed: {escape(str(exc))}[/red]")
            return
        for f in made:
            figures.append(f)
            console.print(escape(f"  {f.name}: {quantity(f.value, f.unit)}  target {f.target}  -> {f.verdict}"))
        console.print(f"  ({time.monotonic() - t0:.0f} s)")

    section("learner", "learner step", lambda: [learner_figure(quick), serving_figure(quick, out)])
    section("memory", "learner memory (FSDP2)", lambda: learner_memory_figures(quick, out))
    section("fitter", "fitter", lambda: [fitter_figure(quick)])
    if quick:
        figures.extend(not_run(name, unit, targets, "full mode only") for name, unit, targets in sweep_figure_names())
    else:
        section("sweep", "sweep rule on simulated sweeps", sweep_figures)
    section("transfer", "weight transfer", lambda: transfer_figures(quick, out))
    section("broker", "broker", lambda: [broker_figure(quick, out)])
    runs: dict[str, StackRun] = {}

    def stack_figures() -> list[Figure]:
        runs["inflight"] = measured_run(out, "pipeline-inflight", steps, mode="async")
        swap = swap_figure(runs["inflight"].run_dir, runs["inflight"].model_dir)
        if quick:  # the engine alone would be a second engine start, most of a quick run's stack section
            return [
                not_run("pipeline_samples_per_s_inflight_vs_sync", "samples/s", PIPELINE_TARGETS, "full mode only"),
                not_run(GENERATOR_FIGURE, "tokens/s", GENERATOR_TARGETS, "full mode only"),
                swap,
            ]
        standalone = standalone_generator(runs["inflight"], out, window_s=8.0)
        runs["sync"] = run_stack(out, "pipeline-sync", mode="sync", max_steps=steps, eval_every_versions=steps)
        return [
            pipeline_figure(runs["inflight"].run_dir, runs["sync"].run_dir),
            generator_figure(runs["inflight"], standalone),
            swap,
        ]

    section("stack", "pipeline, generator efficiency and weight swaps (local stack)", stack_figures)
    if quick:
        figures.append(not_run(learning_speed.NAME, "s", (learning_speed.TARGET,), "full mode only"))
    else:
        section(
            "learning",
            "learning speed (local stack vs single-process on-policy)",
            lambda: [learning_speed.measure(out / "learning")],
        )

        def sweep() -> list[Figure]:
            report["scaling"] = scaling_sweep(out, 20, runs.get("inflight"))
            plot_scaling(report["scaling"], out / "scaling.png")
            return []

        section("scaling", "scaling sweep", sweep)
    report["wall_s"] = time.monotonic() - started
    write_report(out, report, figures)
    return report, figures


def writable_dir(path: Path) -> Path:
    """``path`` resolved, created if missing; ConfigError naming ``--output`` when it cannot be written."""
    try:
        path = path.resolve()
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--output {path}: cannot create the directory: {exc.strerror or exc}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {path}: the directory is not writable")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="asymptote bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="directory for bench.json, bench.md and the runs")
    parser.add_argument("--quick", action="store_true", help="CI smoke run (a few minutes)")
    parser.add_argument(
        "--only", choices=SECTIONS, metavar="SECTION", help=f"run this section alone: {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help="only the data plane at scale: one broker against 1-256 simulated generators, and chaos "
        "(benchmarks.scale; a few minutes)",
    )
    args = parser.parse_args(argv)
    out = writable_dir(args.output)
    try:
        with interrupt_on_sigterm():
            if args.scale:
                from benchmarks.scale import bench_scale, table

                print(table(bench_scale(out)))
                return 0
            report, figures = run_all(out, args.quick, args.only)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every process the bench started is stopped[/yellow]")
        return INTERRUPTED
    print((out / "bench.md").read_text())
    if report["errors"]:
        console.print(f"[red]{len(report['errors'])} benchmark(s) failed to run[/red]")
        return 1
    missed = [f.name for f in figures if f.met is False]
    console.print(
        f"{len(figures) - len(missed)} of {len(figures)} figures met or not run; missed: {', '.join(missed) or 'none'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
