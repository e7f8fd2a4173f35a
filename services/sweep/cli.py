"""``asymptote sweep``: what a sweep spec runs, checked before anything starts.

    asymptote sweep plan SPEC [--json]
    asymptote sweep run SPEC --dir DIR [--audit]
    asymptote sweep replay RUN_DIR... [--spec SPEC] [--out DIR]
    asymptote sweep promote DIR --budget X [--arm NAME]

``plan`` reads ``sweep.yaml`` (services/sweep/spec.py), resolves every arm
into the whole config its runs start from, checks that the machine can
place ``at_once`` runs, and prints the arms (what each changes from the
base), the seeds, the runs, the budget per arm and in all, and the planned
looks at which the rule judges the arms. ``run`` runs them
(services/sweep/controller.py): each run an ``asymptote up`` subprocess,
``at_once`` at a time on one nats-server (the base's ``nats_url``, else one
the sweep starts in DIR), stopped at a planned look when its arm is dominated
or unstable (``--audit``: logged only), with a live table of the arms;
the same command with the same ``--dir`` continues a sweep whose
controller was stopped or killed. A spec that is wrong, or a ``--dir``
holding another spec's sweep, is one line naming what is wrong, exit 2,
and nothing starts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from asymptote.cli_args import ArgumentParser
from asymptote.compute import flops_text
from asymptote.errors import ConfigError
from services.sweep.spec import ArmPlan, SweepSpec, planned


def _overrides_text(plan: ArmPlan) -> str:
    changes = ", ".join(f"{k}: {v}" for k, v in plan.overrides.items()) or "(the base)"
    return f"{plan.reverts} ({changes})" if plan.reverts else changes


def plan_json(spec: SweepSpec, plans: list[ArmPlan]) -> dict[str, object]:
    """The plan as ``--json`` prints it: every arm's overrides and config, the seeds, budget and looks."""
    runs = len(plans) * spec.seeds
    return {
        "arms": [
            {
                "name": p.name,
                "overrides": p.overrides,
                "reverts": p.reverts or None,
                "config": p.config.model_dump(mode="json", exclude={"run_dir", "prefix", "nats_url", "seed"}),
            }
            for p in plans
        ],
        "seeds": spec.seeds,
        "extra_seeds": spec.extra_seeds,
        "runs": runs,
        "at_once": spec.at_once,
        "budget_per_arm": spec.budget.per_arm,
        "budget_total": spec.budget.total if spec.budget.total is not None else runs * spec.budget.per_arm,
        "warmup": spec.warmup,
        "looks": list(spec.settings.looks),
        "look_alpha": spec.settings.look_alpha(len(plans)),
        "margin": spec.margin,
        "alpha": spec.alpha,
    }


def print_plan(spec: SweepSpec, plans: list[ArmPlan], console: Console) -> None:
    table = Table(title=f"{len(plans)} arms x {spec.seeds} seed{'s' if spec.seeds > 1 else ''}")
    table.add_column("arm")
    table.add_column("changes from the base")
    for p in plans:
        table.add_row(p.name, _overrides_text(p))
    console.print(table)
    settings = spec.settings
    runs = len(plans) * spec.seeds
    total = spec.budget.total if spec.budget.total is not None else runs * spec.budget.per_arm
    looks = ", ".join(flops_text(c) for c in settings.looks)
    console.print(
        f"{runs} runs, {spec.at_once} at a time; each to {flops_text(spec.budget.per_arm)} unless stopped, "
        f"{flops_text(total)} in all\n"
        f"judged from {flops_text(spec.warmup)} at {len(settings.looks)} looks: {looks}\n"
        f"margin {spec.margin}, error rate {spec.alpha} ({settings.look_alpha(len(plans)):.4f} a comparison at a "
        "look, Bonferroni)"
        + (
            f"\nup to {spec.extra_seeds} extra seed{'s' if spec.extra_seeds > 1 else ''} for an undecided leader and "
            "its closest challenger, within the total"
            if spec.extra_seeds
            else ""
        )
    )


def arms_table(summary: Mapping[str, Any]) -> Table:
    """The live view of a sweep: each arm's status, compute, A [lo, hi] of its runs, and decision."""
    table = Table(title=f"sweep{' (audit: nothing is stopped)' if summary['audit'] else ''}")
    for column in ("arm", "status", "compute", "A [lo, hi]", "decision"):
        table.add_column(column)
    for arm in summary["arms"]:
        fit = arm["fit"]
        shown = "-"
        if fit is not None and fit["a_low"] is not None:
            shown = f"{fit['a']:.3f} [{fit['a_low']:.3f}, {fit['a_high']:.3f}]" + (
                "" if fit["determined"] else " not determined"
            )
        decision = "" if arm["decision"] is None else f"{arm['decision']} ({arm['action']})"
        seeds = len(arm["seeds"])
        table.add_row(
            arm["name"],
            f"{arm['status']} ({seeds} seed{'s' if seeds > 1 else ''})",
            flops_text(arm["compute"]),
            shown,
            decision,
        )
    return table


def run_sweep(args: Any) -> int:
    from rich.live import Live

    from services.sweep.controller import Controller
    from services.sweep.launcher import LocalLauncher, SharedNats

    spec, plans = planned(args.spec)
    directory = args.dir.resolve()
    # One nats-server for every run, unless the base names one already running.
    nats = None if spec.base.get("nats_url") else SharedNats(directory)
    held: list[Controller] = []
    if args.metrics_port is not None:  # before the sweep's folder is made: a port in use starts nothing
        from prometheus_client import CollectorRegistry, start_http_server

        from services.sweep.metrics import SweepCollector

        registry = CollectorRegistry()
        registry.register(SweepCollector(lambda: held[0].latest))
        try:
            start_http_server(args.metrics_port, registry=registry)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {args.metrics_port}: cannot serve metrics there: {exc}") from exc
    controller = Controller(spec, plans, directory, LocalLauncher(), audit=args.audit, nats=nats)
    held.append(controller)
    console = Console()
    try:
        with Live(arms_table(controller.summary()), console=console, refresh_per_second=2) as live:
            while not controller.step():
                live.update(arms_table(controller.summary()))
                time.sleep(args.poll_s)
            live.update(arms_table(controller.summary()))
    except KeyboardInterrupt:
        console.print(
            f"stopped the controller; the runs keep running: run it again with --dir {args.dir} to adopt them"
        )
        return 130
    summary = controller.summary(final=True)
    share = summary["compute_share"]
    pick = summary.get("pick")
    console.print(
        f"picked: {pick or 'none (no arm is determined to lead)'}; compute {share:.0%} of every run to its budget"
        if share is not None
        else f"picked: {pick}"
    )
    console.print(f"done: {directory / 'sweep.json'}, {directory / 'decisions.jsonl'}")
    return 0


def promote_pick(args: Any) -> int:
    from services.sweep.promote import promote

    console = Console()

    def show(row: dict[str, Any]) -> None:
        band = "" if row["band"] is None else f" band [{row['band'][0]:.3f}, {row['band'][1]:.3f}]"
        console.print(
            f"{flops_text(row['compute'])}: observed {row['observed']:.3f}, forecast {row['forecast']:.3f}{band}, "
            f"error {row['error']:+.3f}"
        )

    done = promote(args.dir.resolve(), args.budget, args.arm, report=show)
    f = done["forecast"]
    console.print(
        f"{f['arm']}: forecast at {flops_text(f['budget'])} {f['projected']:.3f}"
        + ("" if f["band"] is None else f" [{f['band'][0]:.3f}, {f['band'][1]:.3f}]")
        + ("" if f["determined"] else f" (not determined: {f['why_not']})")
        + (
            ""
            if done["last"] is None
            else f"; last observed {done['last']['observed']:.3f}, error {done['last']['error']:+.3f}"
        )
    )
    return 0


def replay_runs(args: Any) -> int:
    from services.sweep.replay import main_replay
    from services.sweep.spec import load_spec

    settings = load_spec(args.spec).settings if args.spec is not None else None
    return main_replay(args.runs, args.out, args.arm, settings, args.budget, args.warmup)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="asymptote sweep",
        description=__doc__.split("\n\n")[0],
        epilog="plan SPEC [--json]: check a spec and print its plan. run SPEC --dir DIR [--audit] [--metrics-port P]: "
        "run it in DIR (the same DIR continues it); --audit runs every arm to its budget. replay RUN... [--spec SPEC] "
        "[--budget B] [--warmup W] [--arm NAME] [--out DIR]: the rule over finished runs. promote DIR --budget X "
        "[--arm NAME]: continue the pick, its forecast first. docs/sweeps.md",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    plan = sub.add_parser("plan", help="check a sweep spec and print its arms, runs, budget and looks")
    plan.add_argument("spec", type=Path, help="the sweep spec (sweep.yaml)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (every arm's whole config)")
    run = sub.add_parser("run", help="run a sweep: its runs, followed and stopped by the rule at its looks")
    run.add_argument("spec", type=Path, help="the sweep spec (sweep.yaml)")
    run.add_argument("--dir", type=Path, required=True, help="the sweep's folder (its state; the same to continue it)")
    run.add_argument("--audit", action="store_true", help="run every arm to its budget; log what the rule decides")
    run.add_argument("--metrics-port", type=int, default=None, help="serve the sweep's Prometheus metrics here")
    run.add_argument("--poll-s", type=float, default=2.0, help="seconds between looks at the runs' eval.jsonl")
    rep = sub.add_parser("replay", help="the rule over finished runs cut at each look, against their whole curves")
    rep.add_argument("runs", type=Path, nargs="+", help="run directories or sweep folders")
    rep.add_argument("--spec", type=Path, default=None, help="the sweep spec whose warm-up, budget and rule to use")
    rep.add_argument("--budget", type=float, default=None, help="compute per run (default: the shortest run's)")
    rep.add_argument("--warmup", type=float, default=None, help="compute before any look (default: budget / 10)")
    rep.add_argument("--arm", action="append", default=[], help="the arm of each run directory, in order")
    rep.add_argument("--out", type=Path, default=Path("sweep-replay"), help="where replay.json goes")
    pro = sub.add_parser("promote", help="continue the sweep's pick to a larger budget, its forecast recorded first")
    pro.add_argument("dir", type=Path, help="the sweep's folder")
    pro.add_argument("--budget", type=float, required=True, help="compute to continue the run to (above the sweep's)")
    pro.add_argument("--arm", default=None, help="the arm to promote (default: the sweep's pick)")
    args = parser.parse_args(argv)
    if args.action == "promote":
        return promote_pick(args)
    if args.action == "run":
        return run_sweep(args)
    if args.action == "replay":
        return replay_runs(args)
    spec, plans = planned(args.spec)
    if args.json:
        print(json.dumps(plan_json(spec, plans), indent=2))
    else:
        print_plan(spec, plans, Console())
    return 0
