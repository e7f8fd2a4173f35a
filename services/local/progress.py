"""Live progress and the final summary of a local run.

Reads only what the services write to the run directory (``metrics.jsonl``
from the learner, ``eval.jsonl`` and ``fit.json`` from the fitter) and the
services' readiness endpoints: the stack learns nothing through a side
channel. On a terminal it draws a live panel; otherwise it prints a line
every few seconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from services.fitter.holdout import half_run_projection

if TYPE_CHECKING:
    from services.local.config import StackConfig
    from services.local.stack import LocalStack


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return rows


def read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError):
        return {}


class Progress:
    def __init__(self, run_dir: Path, max_steps: int) -> None:
        self.run_dir = run_dir
        self.max_steps = max_steps
        self.console = Console()
        self.started = time.monotonic()
        self.rl_started: float | None = None
        self.rl_finished: float | None = None
        self.outcome = "incomplete"

    def snapshot(self) -> dict[str, Any]:
        steps = read_jsonl(self.run_dir / "metrics.jsonl")
        evals = read_jsonl(self.run_dir / "eval.jsonl")
        fit = read_json(self.run_dir / "fit.json")
        recent = steps[-10:]
        span = (recent[-1]["unix_s"] - recent[0]["unix_s"]) if len(recent) > 1 else 0.0
        samples = sum(r["batch/samples"] for r in recent[1:])
        return {
            "step": steps[-1]["step"] if steps else 0,
            "policy_version": steps[-1]["policy_version"] if steps else 0,
            "batch_pass_rate": steps[-1]["reward/pass_rate"] if steps else None,
            "samples_per_s": samples / span if span > 0 else None,
            "staleness": steps[-1].get("staleness/mean") if steps else None,
            "evals": evals,
            "fit": fit,
        }

    def render(self, stack: LocalStack, snap: dict[str, Any]) -> Table:
        t = Table(title=f"asymptote up — {self.run_dir.name}", show_header=False)
        t.add_column(style="bold")
        t.add_column()
        t.add_row("elapsed", f"{time.monotonic() - self.started:.0f}s")
        t.add_row("learner step", f"{snap['step']} / {self.max_steps}")
        if snap["batch_pass_rate"] is not None:
            t.add_row("batch pass rate", f"{snap['batch_pass_rate']:.3f}")
        if snap["samples_per_s"]:
            t.add_row("trained samples/s", f"{snap['samples_per_s']:.1f}")
        if snap["staleness"] is not None:
            t.add_row("mean staleness", f"{snap['staleness']:.2f} versions")
        evals = snap["evals"]
        if evals:
            first, last = evals[0], evals[-1]
            t.add_row(
                "held-out pass rate",
                f"{last['pass_rate']:.3f} at v{last['policy_version']} (R0 {first['pass_rate']:.3f})",
            )
        fit = snap["fit"]
        if fit.get("ok"):
            a_iv = fit.get("a_interval", {})
            t.add_row(
                "projection",
                f"A {fit['a']:.3f} [{a_iv.get('low', 0):.3f}, {a_iv.get('high', 0):.3f}]  B {fit['b']:.2f}  C_mid {fit['c_mid']:.0f}",
            )
        elif fit.get("reason"):
            t.add_row("projection", f"[dim]{fit['reason']}[/dim]")
        services = "  ".join(
            f"{p.name}:{'[green]ready[/green]' if p.ready else '[red]not ready[/red]'}" for p in stack.procs
        )
        t.add_row("services", services)
        return t

    def line(self, snap: dict[str, Any]) -> str:
        parts = [f"[{time.monotonic() - self.started:5.0f}s] step {snap['step']}/{self.max_steps}"]
        if snap["batch_pass_rate"] is not None:
            parts.append(f"batch pass {snap['batch_pass_rate']:.3f}")
        if snap["evals"]:
            parts.append(f"held-out {snap['evals'][-1]['pass_rate']:.3f}@v{snap['evals'][-1]['policy_version']}")
        if snap["samples_per_s"]:
            parts.append(f"{snap['samples_per_s']:.1f} samples/s")
        if snap["fit"].get("ok"):
            parts.append(f"A {snap['fit']['a']:.3f}")
        return "  ".join(parts)

    def finished(self, snap: dict[str, Any]) -> bool:
        return snap["step"] >= self.max_steps and any(
            e["policy_version"] >= snap["policy_version"] for e in snap["evals"]
        )

    def follow(
        self, stack: LocalStack, config: StackConfig, until: Callable[[dict[str, Any]], bool] | None = None
    ) -> int:
        """Watch the run until it completes (0) or fails (1); ``until(snapshot)`` True also ends it (0)."""
        deadline_ready = time.monotonic() + config.startup_timeout_s
        final_deadline: float | None = None
        last_print = 0.0
        live = Live(console=self.console, refresh_per_second=2) if self.console.is_terminal else None
        if live:
            live.start()
        try:
            while True:
                stack.poll_ready()
                events, failed = stack.supervise()
                for event in events:
                    self.console.print(f"[yellow]{event}[/yellow]")
                if failed:
                    for p in failed:
                        self.console.print(
                            f"[red]{p.name} exited with code {p.popen.returncode} after {p.restarts} restarts"
                            f"[/red]; last log lines:\n{p.tail()}"
                        )
                    self.outcome = f"failed: {', '.join(p.name for p in failed)} exited"
                    return 1
                snap = self.snapshot()
                if self.rl_started is None and snap["step"] > 0:
                    self.rl_started = time.monotonic()
                if snap["step"] == 0 and time.monotonic() > deadline_ready and not all(p.ready for p in stack.procs):
                    waiting = [f"{p.name} ({p.extra.get('detail', '')})" for p in stack.procs if not p.ready]
                    self.console.print(
                        f"[red]services not ready after {config.startup_timeout_s:.0f}s: {waiting}[/red]"
                    )
                    self.outcome = "failed: startup timeout"
                    return 1
                if snap["step"] >= self.max_steps and final_deadline is None:
                    final_deadline = time.monotonic() + config.final_eval_timeout_s
                if self.finished(snap) or (until is not None and until(snap)):
                    self.rl_finished = time.monotonic()
                    self.outcome = "completed" if self.finished(snap) else "stopped: target reached"
                    if live:
                        live.update(self.render(stack, snap))
                    return 0
                if final_deadline is not None and time.monotonic() > final_deadline:
                    self.console.print("[red]the final eval round did not complete in time[/red]")
                    self.outcome = "failed: final eval timeout"
                    return 1
                if live:
                    live.update(self.render(stack, snap))
                elif time.monotonic() - last_print > 10.0:
                    print(self.line(snap), flush=True)
                    last_print = time.monotonic()
                time.sleep(0.5)
        finally:
            if live:
                live.stop()

    def finish(self, stack: LocalStack) -> None:
        snap = self.snapshot()
        evals = snap["evals"]
        fit = snap["fit"]
        r0 = next((e["pass_rate"] for e in evals if e["policy_version"] == 0), None)
        final = evals[-1]["pass_rate"] if evals else None
        rl_s = (self.rl_finished - self.rl_started) if self.rl_started and self.rl_finished else None
        summary = {
            "outcome": self.outcome,
            "steps": snap["step"],
            "heldout_pass_rate_step0": r0,
            "heldout_pass_rate_final": final,
            "heldout_gain": (final - r0) if final is not None and r0 is not None else None,
            "rl_wall_s": rl_s,
            "total_wall_s": time.monotonic() - self.started,
            "fit": {k: fit.get(k) for k in ("ok", "a", "b", "c_mid", "r0", "a_interval", "reason")},
            "half_run_projection": half_run_projection(evals) if evals else None,
            "restarts": {p.name: p.restarts for p in stack.procs if p.restarts},
            "ledger": read_json(self.run_dir / "ledger.json"),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        t = Table(title="run summary", show_header=False)
        for k in (
            "outcome",
            "steps",
            "heldout_pass_rate_step0",
            "heldout_pass_rate_final",
            "heldout_gain",
            "rl_wall_s",
        ):
            v = summary[k]
            t.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
        if fit.get("ok"):
            t.add_row("fit", f"A {fit['a']:.3f}  B {fit['b']:.2f}  C_mid {fit['c_mid']:.1f}  R0 {fit['r0']:.3f}")
        hp = summary["half_run_projection"]
        if hp and hp["projected"] is not None:
            t.add_row(
                "half-run projection",
                f"{hp['projected']:.3f} (interval {hp['interval'][0]:.3f}-{hp['interval'][1]:.3f}) vs measured "
                f"{hp['measured']:.3f}: error {hp['error']:+.3f}",
            )
        ledger = summary["ledger"]
        if ledger:
            t.add_row(
                "ledger",
                f"issued {ledger['issued']}  trained {ledger['trained']}  filtered {sum(ledger['filtered'].values())}"
                f"  dead-lettered {ledger['deadlettered']}  in flight {ledger['in_flight']}"
                f"  lost {ledger['lost']}  trained twice {ledger['trained_twice']}",
            )
        if summary["restarts"]:
            t.add_row("restarts", ", ".join(f"{k} {v}" for k, v in summary["restarts"].items()))
        t.add_row("run directory", str(self.run_dir))
        self.console.print(t)
