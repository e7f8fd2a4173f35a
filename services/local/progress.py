"""Live progress and the final summary of a local run: what is shown, not what is done.

Reads only what the services write to the run directory (``metrics.jsonl``
from the learner, ``eval.jsonl`` and ``fit.json`` from the fitter) and what
the stack hands it (each service's readiness, restarts): the stack learns
nothing through a side channel. A mixture of tasks has one held-out curve
and fit per sub-task (eval rows tagged ``task``, fit.json's ``tasks``): the
line, the panel and the summary name each sub-task's pass rate and fit. Renders a live panel (for a terminal) or a
line, and writes ``summary.json``. Knows nothing of processes: the stack
(services.local.stack) drives the run and calls it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from asymptote.compute import ComputeUnit, device_time, flops_text
from asymptote.compute import compute_text as unit_text
from services.fitter.holdout import half_run_projection


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


FIT_SUMMARY_KEYS = (
    "determined",
    "why_not_determined",
    "not_determined",
    "ok",
    "reason",
    "a",
    "b",
    "c_mid",
    "r0",
    "a_interval",
    "c_mid_interval",
    "at_bound",
    "identifiable",
    "planned_compute",
    "compute_unit",
    "projections",
    "not_determined_point_estimates",
    "recommendation",
    "recommendation_reason",
)
"""What ``summary.json`` keeps of the fitter's ``fit.json``, in this order (led by whether the fit is
determined) and only those it has: a fit not determined has no bare ``a``, ``b``, ``c_mid`` (its point values
are under ``not_determined_point_estimates``), a run without a budget no ``planned_compute``."""


def fit_summary(fit: Mapping[str, Any]) -> dict[str, Any]:
    """``FIT_SUMMARY_KEYS`` of one fit.json fit, those it has."""
    return {k: fit[k] for k in FIT_SUMMARY_KEYS if k in fit}


def eval_tasks(evals: list[dict[str, Any]]) -> list[str]:
    """The sub-tasks a mixture's eval rows name, in order of first appearance; empty for a single task."""
    return list(dict.fromkeys(e["task"] for e in evals if isinstance(e.get("task"), str)))


def curves(evals: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The eval rows of each curve: ``{"": rows}`` for a single task, else each sub-task's rows by name."""
    tasks = eval_tasks(evals)
    if not tasks:
        return {"": evals}
    return {task: [e for e in evals if e.get("task") == task] for task in tasks}


def curve_fits(fit: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """fit.json's fit of each curve: ``{"": fit}`` for a single task, else fit.json's ``tasks``."""
    tasks = fit.get("tasks")
    return dict(tasks) if isinstance(tasks, Mapping) else {"": fit}


def heldout_gain(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """One curve's held-out pass rate at version 0 and at its last round, and the gain between them."""
    r0 = next((e["pass_rate"] for e in rows if e["policy_version"] == 0), None)
    final = rows[-1]["pass_rate"] if rows else None
    return {
        "heldout_pass_rate_step0": r0,
        "heldout_pass_rate_final": final,
        "heldout_gain": (final - r0) if final is not None and r0 is not None else None,
    }


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known and len(known) == len(values) else None


def compute_text(by_service: Mapping[str, float], flops_by_service: Mapping[str, float] | None = None) -> str | None:
    """The run's compute: training (the curve's axis) by service with the eval rounds' sampling apart, in FLOPs
    where the fitter counted them; then the device time held, the run's cost. A fit.json written before the
    FLOPs axis has device time only, and that is the axis. Each quantity's parts are in the unit its
    training total takes (never "0.20 device-hours (generator 340 device-s, ...)")."""

    def spent(values: Mapping[str, float], text: Callable[..., str]) -> tuple[str, str]:
        train = {k: v for k, v in values.items() if k != "eval"}
        total = sum(train.values())
        evals = values.get("eval", 0.0)
        generation = values.get("generator", 0.0) + evals

        def shown(value: float) -> str:
            return str(text(value, unit_of=total))

        services = ", ".join(f"{k} {shown(v)}" for k, v in sorted(train.items()))
        share = f", {evals / generation:.0%} of generation" if generation > 0 else ""
        return f"{shown(total)} ({services})", f"{shown(evals)}{share}"

    if flops_by_service:
        train, evals = spent(flops_by_service, flops_text)
        text = f"training {train}; eval sampling {evals}, off the curve's axis"
        if by_service:
            held, held_evals = spent(by_service, device_time)
            text += f"; held {held} and {held_evals.split(',')[0]} sampling evals: the run's cost"
        return text
    if not by_service:
        return None
    train, evals = spent(by_service, device_time)
    return f"training {train}; eval sampling {evals}, off the curve's axis"


def _interval(interval: Mapping[str, Any] | None) -> str:
    iv = interval or {}
    return f"[{iv.get('low', 0.0):.3f}, {iv.get('high', 0.0):.3f}]"


def fit_unit(fit: Mapping[str, Any]) -> ComputeUnit:
    """The compute axis of a fit.json fit (one written before the FLOPs axis: device-seconds)."""
    return "flops" if fit.get("compute_unit") == "flops" else "device_seconds"


def budget_projection(fit: Mapping[str, Any]) -> str | None:
    """The projected pass rate at the planned budget with its interval, e.g. "at budget 5.00 device-hours: 0.571
    [0.560, 0.590]"; None without a budget (no ``planned_compute``) or its projection."""
    budget = float(fit.get("planned_compute") or 0.0)
    if budget <= 0:
        return None
    for projection in fit.get("projections") or ():
        if math.isclose(float(projection.get("compute", 0.0)), budget, rel_tol=1e-9):
            shown = f"{projection['pass_rate']:.3f} {_interval(projection.get('interval'))}"
            return f"at budget {unit_text(budget, fit_unit(fit))}: {shown}"
    return None


NOT_DETERMINED_BRIEF = {
    "few_points": "too few points",
    "at_bound": "a parameter at its bound",
    "a_at_cap": "A's interval reaches the cap",
    "a_at_floor": "A's interval reaches R0",
    "c_mid_spread": "C_mid's interval too wide",
}
"""The live line's few words for each reason a fit is not determined (fit.json's ``not_determined``);
the panel, the summary and fit.json say it in full, with what would determine it."""


def a_text(fit: Mapping[str, Any], brief: bool = False) -> str | None:
    """A as an ok fit lets one state it, never a bare point estimate: a determined fit's A with its
    interval and the projection at the planned budget ("A 0.544 [0.526, 0.568]  at budget ..."); else
    only A's interval and what keeps the fit from being determined ("A in [0.515, 1.000], not yet
    determined: ..."), and not even the interval while too few points were fitted for their bootstrap
    interval to mean anything ("few_points"). None without an ok fit."""
    if not fit.get("ok"):
        return None
    interval = _interval(fit.get("a_interval"))
    if not fit.get("determined"):
        why = fit.get("why_not_determined") or "the fitter does not say it is"
        kinds = list(fit.get("not_determined") or ())
        if brief:  # the live line: the first reason in a few words, and how many more
            why = NOT_DETERMINED_BRIEF.get(kinds[0], kinds[0]) if kinds else why
            why += f" (+{len(kinds) - 1})" if len(kinds) > 1 else ""
        if "few_points" in kinds:
            return f"A not yet determined: {why}"
        return f"A in {interval}, not yet determined: {why}"
    text = f"A {fit['a']:.3f} {interval}"
    at_budget = budget_projection(fit)
    return f"{text}  {at_budget}" if at_budget else text


def fit_text(fit: Mapping[str, Any]) -> str | None:
    """The fit in one line for people: a determined fit's A, B, C_mid (A and C_mid with their intervals),
    R0, the projection at the planned budget and the recommendation; an undetermined fit as ``a_text``
    states it, and R0 (its recommendation is "continue" for the reason ``a_text`` gives). The reason when
    there is no fit, None before the fitter has said anything."""
    if not fit.get("ok"):
        reason = fit.get("reason")
        return str(reason) if reason else None
    if not fit.get("determined"):
        return f"{a_text(fit)}  R0 {fit['r0']:.3f}"
    c_mid = fit.get("c_mid_interval") or {}
    text = (
        f"A {fit['a']:.3f} {_interval(fit.get('a_interval'))}  B {fit['b']:.2f}  "
        f"C_mid {unit_text(fit['c_mid'], fit_unit(fit), c_mid.get('low', 0.0), c_mid.get('high', 0.0))}  "
        f"R0 {fit['r0']:.3f}"
    )
    at_budget = budget_projection(fit)
    if at_budget:
        text += f"  {at_budget}"
    if fit.get("recommendation"):
        text += f"  {fit['recommendation']}: {fit.get('recommendation_reason', '')}"
    return text


TRUNCATION_WINDOW_STEPS = 20
"""Steps over which a truncation rate is taken for the stability check."""
UNSTABLE_TRUNCATION = 0.05
"""A truncation rate (over TRUNCATION_WINDOW_STEPS steps) from which a run is marked unstable: ScaleRL's
stable runs stayed below 5% and its failed ones climbed to 10-15% (arXiv 2510.13786)."""


def _truncation(steps: list[dict[str, Any]]) -> float | None:
    completions = sum(r.get("rollout/completions", 0.0) for r in steps)
    return sum(r.get("rollout/truncated", 0.0) for r in steps) / completions if completions else None


def length_rates(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the whole run: the interruption and truncation rates of every completion generated (before
    any filter, as the broker counted them), the truncation rate of the trained batches (after it), and
    the highest truncation rate over any TRUNCATION_WINDOW_STEPS steps, with whether it made the run
    unstable (``unstable``: that rate at UNSTABLE_TRUNCATION or more)."""
    completions = sum(r.get("rollout/completions", 0.0) for r in steps)
    trained = sum(r.get("batch/samples", 0.0) for r in steps)
    counted = [r for r in steps if r.get("rollout/completions")]
    windows = [
        _truncation(counted[i : i + TRUNCATION_WINDOW_STEPS])
        for i in range(max(1, len(counted) - TRUNCATION_WINDOW_STEPS + 1))
    ]
    worst = max((w for w in windows if w is not None), default=None)
    return {
        "interruption_rate": sum(r.get("rollout/interrupted", 0.0) for r in steps) / completions
        if completions
        else None,
        "truncation_rate": _truncation(steps),
        "trained_truncation_rate": sum(r.get("batch/truncation_rate", 0.0) * r.get("batch/samples", 0.0) for r in steps)
        / trained
        if trained
        else None,
        "max_window_truncation_rate": worst,
        "unstable": worst is not None and worst >= UNSTABLE_TRUNCATION,
    }


def truncation_warning(steps: list[dict[str, Any]]) -> str | None:
    """What the live line says of the truncation rate over the last TRUNCATION_WINDOW_STEPS steps, when it
    is UNSTABLE_TRUNCATION or more: a run truncated that much from its first steps has max_tokens too short
    for its task; one whose rate climbed there is destabilising (the policy stopped ending its answers),
    which a longer cap would not cure."""
    counted = [r for r in steps if r.get("rollout/completions")]
    recent = _truncation(counted[-TRUNCATION_WINDOW_STEPS:])
    if recent is None or recent < UNSTABLE_TRUNCATION:
        return None
    first = _truncation(counted[:TRUNCATION_WINDOW_STEPS]) or 0.0
    if first >= UNSTABLE_TRUNCATION:
        return (
            f"{recent:.0%} of completions hit max_tokens, {first:.0%} from the start: max_tokens is short for the task"
        )
    return (
        f"unstable: truncation rose from {first:.0%} to {recent:.0%} over the last {TRUNCATION_WINDOW_STEPS} steps "
        "(ScaleRL's stable runs stayed below 5%)"
    )


def duration(seconds: float) -> str:
    """``seconds`` for a reader: 45s, 12m, 3h05m."""
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


class Progress:
    """One run's progress as the run directory shows it, and how it ended (set by the stack)."""

    def __init__(self, run_dir: Path, max_steps: int) -> None:
        self.run_dir = run_dir
        self.max_steps = max_steps
        self.console = Console()
        self.started = time.monotonic()
        """When the run started (monotonic seconds)."""
        self.rl_started: float | None = None
        """When the learner's first step was seen."""
        self.rl_finished: float | None = None
        """When the run was seen complete (or its ``until`` met)."""
        self.outcome = "incomplete"

    def snapshot(self) -> dict[str, Any]:
        steps = read_jsonl(self.run_dir / "metrics.jsonl")
        evals = read_jsonl(self.run_dir / "eval.jsonl")
        fit = read_json(self.run_dir / "fit.json")
        recent = steps[-10:]
        span = (recent[-1]["unix_s"] - recent[0]["unix_s"]) if len(recent) > 1 else 0.0
        samples = sum(r["batch/samples"] for r in recent[1:])
        tokens = sum(r.get("batch/tokens", 0.0) for r in recent[1:])
        step = steps[-1]["step"] if steps else 0
        per_step = span / (len(recent) - 1) if span > 0 else None
        return {
            "step": step,
            "policy_version": steps[-1]["policy_version"] if steps else 0,
            "batch_pass_rate": steps[-1]["reward/pass_rate"] if steps else None,
            "samples_per_s": samples / span if span > 0 else None,
            "tokens_per_s": tokens / span if span > 0 else None,
            "eta_s": per_step * max(0, self.max_steps - step) if per_step is not None else None,
            "truncation_warning": truncation_warning(steps),
            "staleness": steps[-1].get("staleness/mean") if steps else None,
            "evals": evals,
            "fit": fit,
        }

    @staticmethod
    def waiting(snap: dict[str, Any], ready: Mapping[str, bool], details: Mapping[str, str]) -> str | None:
        """What the run waits for before its first step, or None once steps are coming.

        ``ready`` is each service's readiness by name and ``details`` what a
        service that is not ready says it waits for (its /readyz detail).
        """
        if snap["step"] > 0:
            return None
        starting = [f"{name} ({details[name]})" if details.get(name) else name for name, ok in ready.items() if not ok]
        if starting:
            return "starting " + ", ".join(starting)
        return "waiting for the first batch of rollouts"

    def render(
        self, snap: dict[str, Any], ready: Mapping[str, bool], details: Mapping[str, str] | None = None
    ) -> Table:
        """The live panel for ``snap``, with each service's readiness (``ready``, by name) and,
        for those not ready, what they wait for (``details``)."""
        t = Table(title=f"asymptote up — {self.run_dir.name}", show_header=False)
        t.add_column(style="bold")
        t.add_column()
        t.add_row("elapsed", f"{time.monotonic() - self.started:.0f}s")
        t.add_row("learner step", f"{snap['step']} / {self.max_steps}")
        waiting = self.waiting(snap, ready, details or {})
        if waiting is not None:
            t.add_row("waiting", waiting)
        if snap["batch_pass_rate"] is not None:
            t.add_row("batch pass rate", f"{snap['batch_pass_rate']:.3f}")
        if snap["samples_per_s"]:
            t.add_row("trained samples/s", f"{snap['samples_per_s']:.1f}")
        if snap.get("tokens_per_s"):
            t.add_row("trained tokens/s", f"{snap['tokens_per_s']:,.0f}")
        if snap.get("eta_s") is not None and snap["step"] < self.max_steps:
            t.add_row("time left", f"about {duration(snap['eta_s'])} at this pace")
        if snap.get("truncation_warning"):
            t.add_row("[yellow]warning[/yellow]", snap["truncation_warning"])
        if snap["staleness"] is not None:
            t.add_row("mean staleness", f"{snap['staleness']:.2f} versions")
        evals = snap["evals"]
        for task, rows in curves(evals).items() if evals else ():
            first, last = rows[0], rows[-1]
            t.add_row(
                f"held-out pass rate{f' ({task})' if task else ''}",
                f"{last['pass_rate']:.3f} at v{last['policy_version']} (R0 {first['pass_rate']:.3f})",
            )
        for task, fit in curve_fits(snap["fit"]).items():
            text = fit_text(fit)
            if text is not None:
                t.add_row(f"projection{f' ({task})' if task else ''}", text if fit.get("ok") else f"[dim]{text}[/dim]")
        services = "  ".join(
            f"{name}:{'[green]ready[/green]' if is_ready else '[red]not ready[/red]'}"
            for name, is_ready in ready.items()
        )
        t.add_row("services", services)
        return t

    def line(
        self, snap: dict[str, Any], ready: Mapping[str, bool] | None = None, details: Mapping[str, str] | None = None
    ) -> str:
        parts = [f"[{time.monotonic() - self.started:5.0f}s] step {snap['step']}/{self.max_steps}"]
        waiting = self.waiting(snap, ready or {}, details or {})
        if waiting is not None:
            parts.append(waiting)
        if snap["batch_pass_rate"] is not None:
            parts.append(f"batch pass {snap['batch_pass_rate']:.3f}")
        for task, rows in curves(snap["evals"]).items() if snap["evals"] else ():
            name = f"{task} " if task else ""
            parts.append(f"held-out {name}{rows[-1]['pass_rate']:.3f}@v{rows[-1]['policy_version']}")
        if snap["samples_per_s"]:
            parts.append(f"{snap['samples_per_s']:.1f} samples/s")
        if snap.get("tokens_per_s"):
            parts.append(f"{snap['tokens_per_s']:,.0f} tokens/s")
        if snap.get("eta_s") is not None and snap["step"] < self.max_steps:
            parts.append(f"ETA {duration(snap['eta_s'])}")
        if snap.get("truncation_warning"):
            parts.append(f"warning: {snap['truncation_warning']}")
        for task, fit in curve_fits(snap["fit"]).items():
            a = a_text(fit, brief=True)
            if a is not None:
                parts.append(f"{task}: {a}" if task else a)
        return "  ".join(parts)

    def finished(self, snap: dict[str, Any]) -> bool:
        """Every step is trained and an eval round has measured the last policy version (a mixture: one
        round of each sub-task)."""
        return (
            snap["step"] >= self.max_steps
            and bool(snap["evals"])
            and all(
                any(e["policy_version"] >= snap["policy_version"] for e in rows)
                for rows in curves(snap["evals"]).values()
            )
        )

    def finish(self, restarts: Mapping[str, int], killed_at_stop: Sequence[str] = ()) -> None:
        """Write ``summary.json`` and print the summary; ``restarts``: each service's restarts, by name;
        ``killed_at_stop``: the processes that did not end by themselves when the run stopped."""
        snap = self.snapshot()
        evals = snap["evals"]
        fit = snap["fit"]
        by_curve = curves(evals) if evals else {}
        gains = {task: heldout_gain(rows) for task, rows in by_curve.items()}
        rl_s = (self.rl_finished - self.rl_started) if self.rl_started and self.rl_finished else None
        mixed = bool(eval_tasks(evals)) or "tasks" in fit
        # A mixture's top-level figures are the mean over its sub-tasks (each one's is in heldout_by_task).
        overall = (
            {key: _mean([g[key] for g in gains.values()]) for key in next(iter(gains.values()))}
            if mixed and gains
            else gains.get("", heldout_gain([]))
        )
        summary = {
            "outcome": self.outcome,
            "steps": snap["step"],
            **overall,
            "rl_wall_s": rl_s,
            "total_wall_s": time.monotonic() - self.started,
            "fit": fit_summary(fit)
            if not mixed
            else {"tasks": {task: fit_summary(f) for task, f in curve_fits(fit).items()}},
            "half_run_projection": half_run_projection(evals) if evals and not mixed else None,
            "restarts": {name: n for name, n in restarts.items() if n},
            "killed_at_stop": list(killed_at_stop),
            "ledger": read_json(self.run_dir / "ledger.json"),
            "length": length_rates(read_jsonl(self.run_dir / "metrics.jsonl")),
            "compute_by_service": fit.get("compute_by_service") or {},
            "flops_by_service": fit.get("flops_by_service") or {},
        }
        if mixed:
            summary["heldout_by_task"] = gains
            summary["half_run_projection_by_task"] = {
                task: half_run_projection(rows) for task, rows in by_curve.items()
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
        if mixed:
            for task, gain in gains.items():
                t.add_row(
                    f"held-out ({task})",
                    "  ".join(f"{k.removeprefix('heldout_')} {v:.3f}" for k, v in gain.items() if v is not None),
                )
        for task, task_fit in curve_fits(fit).items():
            text = fit_text(task_fit)
            if text is not None:
                said = "determined" if task_fit.get("determined") else "not determined"
                t.add_row(f"fit ({task}, {said})" if task else f"fit ({said})", text)
        checks = summary.get("half_run_projection_by_task") or {"": summary["half_run_projection"]}
        for task, hp in checks.items():
            if hp:
                t.add_row(f"half-run check ({task})" if task else "half-run check", hp["verdict_text"])
        rates = summary["length"]
        if rates["truncation_rate"] is not None:
            t.add_row(
                "length",
                f"interrupted {rates['interruption_rate']:.3f}  truncated {rates['truncation_rate']:.3f} "
                f"of all completions; truncated {rates['trained_truncation_rate'] or 0.0:.3f} of those trained; "
                f"at most {rates['max_window_truncation_rate'] or 0.0:.3f} over {TRUNCATION_WINDOW_STEPS} steps"
                + ("  [yellow]unstable[/yellow]" if rates["unstable"] else ""),
            )
        compute = compute_text(summary["compute_by_service"], summary["flops_by_service"])
        if compute is not None:
            t.add_row("compute", compute)
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
        if summary["killed_at_stop"]:
            t.add_row("killed at stop", ", ".join(summary["killed_at_stop"]) + " (did not end after SIGTERM)")
        t.add_row("run directory", str(self.run_dir))
        self.console.print(t)
