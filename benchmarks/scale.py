"""The data plane at cluster scale: one broker process against 1 to 256 simulated generators, and chaos.

Owns the sweep and the chaos run over :mod:`benchmarks.dataplane`'s fleet,
their report (``scale.json``, ``bench.md``) and plot (``scaling-broker.png``).
One real nats-server serves the whole run; each point starts one real
broker process on a fresh prefix, runs ``--generators`` simulated
generators and the simulated learner for a warm-up and a measured window,
drains, audits the ledger, and stops the broker. Per point: groups/s
trained over the window, NextBatch p50 and p99, the learner's wait
fraction, task redeliveries, the audit's lost and trained-twice counts,
staleness drops, and the CPU (cores) and peak RSS of the broker, the
nats-server and the simulator. The saturation point is the first point
that delivers less than 80% of what its generators offer, named with the
process that ran out of CPU.

The chaos run (64 generators): after a warm-up and a baseline window, a
third of the generators die at random (their leases lapse and come back
after ``task_ack_wait_s``) and come back 3 s later, and the broker is
SIGKILLed once and started again, while the load runs. Reported: the
audit (lost and trained twice must be 0) and the time from the broker's
kill until the learner's throughput over the trailing 2 s is back to 75%
of its baseline (its wait fraction back near its baseline), held to
``RECOVERY_BOUND_S``.

    python -m benchmarks.scale --output DIR [--generators 1,4,16,64,256] [--window-s 10] [--no-chaos]
        [--group-size 8] [--completion-tokens 128] [--batch-prompts 128]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from asymptote.jetstream.names import Names
from asymptote.nats_local import NatsServer, start_nats
from benchmarks.dataplane import (
    BrokerProcess,
    FleetCounts,
    LoadShape,
    SimGenerator,
    SimLearner,
    announce_first_version,
    audit_run,
    step_figures,
)
from benchmarks.harness import ProcessMeter

GENERATORS = (1, 4, 16, 64, 256)
SATURATED_BELOW = 0.8
"""A point delivering less than this share of what its generators offer is saturated."""
RECOVERY_BOUND_S = 20.0
"""The chaos run's learner must be back to RECOVERED_SHARE of its baseline rate within this after the broker's kill."""
RECOVERED_SHARE = 0.75
WARMUP_STEPS = 5
"""The chaos run's baseline starts once the learner has taken this many batches."""
TRAILING_S = 2.0
"""The window the chaos run's recovery is judged over."""
REPORT_FILE = "scale.json"
TABLE_FILE = "bench.md"
PLOT_FILE = "scaling-broker.png"
_prefixes = itertools.count()


class Fleet:
    """One broker process, the simulated learner and generators, and the meters, for one point or the chaos run."""

    def __init__(self, server: NatsServer, workdir: Path, shape: LoadShape, num_generators: int) -> None:
        self.server = server
        self.shape = shape
        self.names = Names(f"scale{next(_prefixes)}g{num_generators}")
        self.broker = BrokerProcess(server.url, self.names, shape, workdir)
        self.learner = SimLearner(self.broker.endpoint, shape)
        self.counts = FleetCounts()
        self.generators = [
            SimGenerator(i, server.url, self.names, shape, self.learner, self.counts) for i in range(num_generators)
        ]
        self.meters: dict[str, ProcessMeter] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        pid = await self.broker.start()
        await announce_first_version(self.server.url, self.names)
        self.meters = {
            "broker": ProcessMeter(pid),
            "nats": ProcessMeter(self.server.process.pid),
            "simulator": ProcessMeter(os.getpid()),
        }
        self._tasks = [asyncio.create_task(self.learner.run(self._stop)), asyncio.create_task(self._sample())]
        for g in self.generators:
            g.start()

    async def _sample(self) -> None:
        while not self._stop.is_set():
            for m in self.meters.values():
                m.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.5)

    async def steps_done(self, num: int, timeout_s: float) -> None:
        """Wait until the learner has taken ``num`` batches; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while len(self.learner.steps) < num:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the learner took {len(self.learner.steps)} of {num} batches in {timeout_s:.0f}s")
            await asyncio.sleep(0.05)  # pacing of the check

    def cpu(self) -> dict[str, float]:
        return {name: m.cpu_s() for name, m in self.meters.items()}

    async def restart_broker(self) -> None:
        """SIGKILL the broker and start it again on the same port; returns once it answers."""
        self.broker.kill()
        self.meters["broker"].replace(await self.broker.start())

    async def finish(self) -> dict[str, Any]:
        """Drain the generators, stop the learner, audit the ledger, stop the broker; the end state."""
        try:
            await asyncio.gather(*(g.stop() for g in self.generators))
            self._stop.set()
            await asyncio.gather(*self._tasks)
            gauges = await self.broker.status()
            result = await audit_run(self.server.url, self.names)
        finally:
            self._stop.set()
            self.broker.stop()
        return {"gauges": gauges, "audit": result.as_dict()}

    async def abort(self) -> None:
        self._stop.set()
        for g in self.generators:
            await g.kill()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.broker.stop()


def process_figures(fleet: Fleet, cpu_before: dict[str, float], cpu_after: dict[str, float], wall_s: float) -> Any:
    return {
        name: {
            "cpu_cores": (cpu_after[name] - cpu_before[name]) / wall_s,
            "peak_rss_mb": fleet.meters[name].peak_rss_bytes / 1e6,
        }
        for name in fleet.meters
    }


async def run_point(
    server: NatsServer, workdir: Path, shape: LoadShape, num_generators: int, warmup_s: float, window_s: float
) -> dict[str, Any]:
    """One point of the sweep (see the module docstring)."""
    fleet = Fleet(server, workdir / f"generators-{num_generators}", shape, num_generators)
    try:
        await fleet.start()
        await asyncio.sleep(warmup_s)  # the window is a span of time by definition
        cpu0, t0 = fleet.cpu(), time.monotonic()
        await asyncio.sleep(window_s)
        cpu1, t1 = fleet.cpu(), time.monotonic()
        end = await fleet.finish()
    except BaseException:
        await fleet.abort()
        raise
    figures = step_figures(fleet.learner.window(t0, t1), t1 - t0)
    offered = shape.offered_groups_per_s(num_generators)
    gauges, audited = end["gauges"], end["audit"]
    processes = process_figures(fleet, cpu0, cpu1, t1 - t0)
    groups = figures["groups_per_s"] * (t1 - t0)
    return {
        "generators": num_generators,
        "offered_groups_per_s": offered,
        **figures,
        "delivered_share": figures["groups_per_s"] / offered,
        "redelivered_tasks": fleet.counts.redelivered_tasks,
        "stale_dropped": int(gauges.get("dropped_stale", 0)),
        "lost": audited["lost"],
        "trained_twice": audited["trained_twice"],
        "audit": audited,
        "processes": processes,
        # CPU per group trained: what bounds one broker core, whatever else shares the machine.
        "broker_cpu_ms_per_group": 1000 * (cpu1["broker"] - cpu0["broker"]) / groups if groups else float("nan"),
        "nats_cpu_ms_per_group": 1000 * (cpu1["nats"] - cpu0["nats"]) / groups if groups else float("nan"),
        "fleet": asdict(fleet.counts),
        "window_s": t1 - t0,
    }


def trailing_rate(learner: SimLearner, now_s: float) -> float:
    return sum(s.num_groups for s in learner.window(now_s - TRAILING_S, now_s + 1e-9)) / TRAILING_S


async def run_chaos(
    server: NatsServer,
    workdir: Path,
    shape: LoadShape,
    num_generators: int = 64,
    warmup_s: float = 60.0,
    baseline_s: float = 5.0,
    seed: int = 0,
) -> dict[str, Any]:
    """The chaos run (see the module docstring)."""
    rng = random.Random(seed)
    fleet = Fleet(server, workdir / "chaos", shape, num_generators)
    try:
        await fleet.start()
        await fleet.steps_done(WARMUP_STEPS, timeout_s=warmup_s)
        t0 = time.monotonic()
        await asyncio.sleep(baseline_s)
        baseline = step_figures(fleet.learner.window(t0, time.monotonic()), time.monotonic() - t0)

        victims = rng.sample(fleet.generators, num_generators // 3)
        await asyncio.gather(*(v.kill() for v in victims))
        killed_generators_at = time.monotonic()

        def come_back() -> None:
            for v in victims:
                v.start()

        comeback = asyncio.get_running_loop().call_later(3.0, come_back)

        await asyncio.sleep(1.0)
        broker_killed_at = time.monotonic()
        await fleet.restart_broker()
        broker_back_s = time.monotonic() - broker_killed_at

        # Recovered: the trailing window after the kill holds RECOVERED_SHARE of the baseline rate.
        target = RECOVERED_SHARE * baseline["groups_per_s"]
        deadline = broker_killed_at + 2 * RECOVERY_BOUND_S
        recovered_at: float | None = None
        while time.monotonic() < deadline:
            now = time.monotonic()
            if now - broker_killed_at >= TRAILING_S and trailing_rate(fleet.learner, now) >= target:
                recovered_at = now
                break
            await asyncio.sleep(0.1)  # pacing of the check
        after_s = 3.0
        await asyncio.sleep(after_s)
        tail = step_figures(fleet.learner.window(time.monotonic() - after_s, time.monotonic()), after_s)
        comeback.cancel()
        end = await fleet.finish()
    except BaseException:
        await fleet.abort()
        raise
    recovery_s = None if recovered_at is None else recovered_at - broker_killed_at
    audited = end["audit"]
    return {
        "generators": num_generators,
        "generators_killed": len(victims),
        "generators_back_after_s": 3.0,
        "broker_killed_after_generators_s": broker_killed_at - killed_generators_at,
        "broker_back_s": broker_back_s,
        "baseline": baseline,
        "recovery_s": recovery_s,
        "recovery_bound_s": RECOVERY_BOUND_S,
        "recovered": recovery_s is not None and recovery_s <= RECOVERY_BOUND_S,
        "after_recovery": tail,
        "lost": audited["lost"],
        "trained_twice": audited["trained_twice"],
        "audit": audited,
        "redelivered_tasks": fleet.counts.redelivered_tasks,
        "learner_ack_retries": fleet.learner.ack_failures,
        "stale_dropped": int(end["gauges"].get("dropped_stale", 0)),
    }


def saturation(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The first point delivering less than SATURATED_BELOW of what it was offered, and the busiest process."""
    for row in rows:
        if row["delivered_share"] < SATURATED_BELOW:
            busiest = max(row["processes"], key=lambda name: row["processes"][name]["cpu_cores"])
            return {
                "generators": row["generators"],
                "groups_per_s": row["groups_per_s"],
                "busiest_process": busiest,
                "busiest_cpu_cores": row["processes"][busiest]["cpu_cores"],
                "broker_cpu_cores": row["processes"]["broker"]["cpu_cores"],
            }
    return None


def table(report: dict[str, Any]) -> str:
    shape = report["shape"]
    lines = [
        "# The data plane at scale: one broker process",
        "",
        f"Machine: {report['machine']}. One nats-server, one broker process per point; simulated generators "
        f"keep {shape['inflight_per_generator']} groups in flight, {shape['generate_s']} s each "
        f"(G={shape['group_size']}, {shape['completion_tokens']} tokens a completion); the simulated learner "
        f"takes batches of {shape['batch_prompts']} and computes {shape['step_s'] * 1000:.0f} ms a step; "
        f"k={shape['staleness_versions']}. Measured over {report['window_s']:.0f} s after {report['warmup_s']:.0f} s "
        "of warm-up. CPU in cores (1.0 = one core busy).",
        "",
        "| generators | offered groups/s | groups/s | delivered | NextBatch p50 ms | p99 ms | learner wait "
        "| task redeliveries | lost | trained twice | stale drops | broker CPU | broker ms CPU/group "
        "| broker RSS MB | nats CPU | nats RSS MB | simulator CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        p = r["processes"]
        lines.append(
            f"| {r['generators']} | {r['offered_groups_per_s']:,.0f} | {r['groups_per_s']:,.0f} "
            f"| {r['delivered_share']:.2f} | {r['next_batch_p50_ms']:.1f} | {r['next_batch_p99_ms']:.1f} "
            f"| {r['learner_wait_fraction']:.2f} | {r['redelivered_tasks']} | {r['lost']} | {r['trained_twice']} "
            f"| {r['stale_dropped']} | {p['broker']['cpu_cores']:.2f} | {r['broker_cpu_ms_per_group']:.3f} "
            f"| {p['broker']['peak_rss_mb']:.0f} "
            f"| {p['nats']['cpu_cores']:.2f} | {p['nats']['peak_rss_mb']:.0f} | {p['simulator']['cpu_cores']:.2f} |"
        )
    sat = report["saturation"]
    lines += [""]
    if sat is None:
        lines.append("Saturation: not reached; every point delivered at least 80% of what its generators offered.")
    else:
        lines.append(
            f"Saturation: at {sat['generators']} generators ({sat['groups_per_s']:,.0f} groups/s delivered, under "
            f"80% of the offer); busiest process: {sat['busiest_process']} at {sat['busiest_cpu_cores']:.2f} cores "
            f"(broker {sat['broker_cpu_cores']:.2f})."
        )
    chaos = report.get("chaos")
    if chaos:
        rec = "not recovered" if chaos["recovery_s"] is None else f"{chaos['recovery_s']:.1f} s"
        lines += [
            "",
            "## Chaos under load",
            "",
            f"{chaos['generators']} generators; {chaos['generators_killed']} killed at random (back after "
            f"{chaos['generators_back_after_s']:.0f} s), then the broker SIGKILLed and started again "
            f"(answering after {chaos['broker_back_s']:.1f} s).",
            "",
            "| baseline groups/s | baseline wait | recovery (to 75% of baseline, trailing 2 s) | bound "
            "| groups/s after | wait after | lost | trained twice | duplicates caught | task redeliveries |",
            "|---|---|---|---|---|---|---|---|---|---|",
            f"| {chaos['baseline']['groups_per_s']:,.0f} | {chaos['baseline']['learner_wait_fraction']:.2f} | {rec} "
            f"| {chaos['recovery_bound_s']:.0f} s | {chaos['after_recovery']['groups_per_s']:,.0f} "
            f"| {chaos['after_recovery']['learner_wait_fraction']:.2f} | {chaos['lost']} | {chaos['trained_twice']} "
            f"| {chaos['audit']['duplicates_caught']} | {chaos['redelivered_tasks']} |",
        ]
    lines += ["", f"![scaling]({PLOT_FILE})", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    xs = [r["generators"] for r in rows]
    fig, (ax, ax_cpu) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.plot(xs, [r["offered_groups_per_s"] for r in rows], "--", color="grey", label="offered by the generators")
    ax.plot(xs, [r["groups_per_s"] for r in rows], "o-", label="trained (through the broker)")
    sat = report["saturation"]
    if sat is not None:
        ax.axvline(sat["generators"], color="red", alpha=0.4, label=f"saturation ({sat['generators']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("simulated generators")
    ax.set_ylabel("groups/s")
    ax.legend(fontsize=8)
    ax.set_title("groups/s through one broker process")
    for name in ("broker", "nats", "simulator"):
        ax_cpu.plot(xs, [r["processes"][name]["cpu_cores"] for r in rows], "o-", label=name)
    ax_cpu.set_xscale("log", base=2)
    ax_cpu.set_xlabel("simulated generators")
    ax_cpu.set_ylabel("CPU (cores)")
    ax_cpu.legend(fontsize=8)
    ax_cpu.set_title("CPU by process")
    fig.suptitle(f"The data plane at scale ({report['machine']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def sweep(
    workdir: Path,
    generators: Sequence[int],
    shape: LoadShape,
    warmup_s: float,
    window_s: float,
    chaos: bool,
) -> dict[str, Any]:
    server = start_nats(workdir / "nats")
    try:
        rows = []
        for n in generators:
            rows.append(await run_point(server, workdir, shape, n, warmup_s, window_s))
            print(
                f"scale: {n} generators: {rows[-1]['groups_per_s']:,.0f} groups/s "
                f"(offered {rows[-1]['offered_groups_per_s']:,.0f}), broker CPU "
                f"{rows[-1]['processes']['broker']['cpu_cores']:.2f}, lost {rows[-1]['lost']}, "
                f"twice {rows[-1]['trained_twice']}",
                flush=True,
            )
        chaos_result = await run_chaos(server, workdir, shape) if chaos else None
    finally:
        server.stop()
    return {
        "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
        "shape": asdict(shape),
        "warmup_s": warmup_s,
        "window_s": window_s,
        "rows": rows,
        "saturation": saturation(rows),
        "chaos": chaos_result,
    }


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    (out / TABLE_FILE).write_text(table(report))
    plot(report, out / PLOT_FILE)


def bench_scale(
    out: Path,
    generators: Sequence[int] = GENERATORS,
    shape: LoadShape | None = None,
    warmup_s: float = 4.0,
    window_s: float = 10.0,
    chaos: bool = True,
) -> dict[str, Any]:
    """Run the sweep (and the chaos run) and write scale.json, bench.md and scaling-broker.png into ``out``."""
    with tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp:
        report = asyncio.run(sweep(Path(tmp), generators, shape or LoadShape(), warmup_s, window_s, chaos))
    write_report(report, out)
    return report


def generator_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give generator counts as positive integers, e.g. 1,4,16")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output", type=Path, required=True, help=f"directory for {REPORT_FILE}, {TABLE_FILE}, {PLOT_FILE}"
    )
    parser.add_argument(
        "--generators",
        type=generator_counts,
        default=list(GENERATORS),
        help="points of the sweep (default 1,4,16,64,256)",
    )
    parser.add_argument("--warmup-s", type=float, default=4.0, help="seconds of each point before its window")
    parser.add_argument("--window-s", type=float, default=10.0, help="seconds each point is measured over")
    parser.add_argument("--no-chaos", action="store_true", help="leave out the chaos run")
    default = LoadShape()
    parser.add_argument("--group-size", type=int, default=default.group_size, help="completions per group (G)")
    parser.add_argument(
        "--completion-tokens", type=int, default=default.completion_tokens, help="tokens per completion"
    )
    parser.add_argument("--batch-prompts", type=int, default=default.batch_prompts, help="groups per learner batch")
    args = parser.parse_args(argv)
    shape = dataclasses.replace(
        default,
        group_size=args.group_size,
        completion_tokens=args.completion_tokens,
        batch_prompts=args.batch_prompts,
    )
    report = bench_scale(args.output, args.generators, shape, args.warmup_s, args.window_s, not args.no_chaos)
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
