"""``asymptote sweep``: what a sweep spec runs, checked before anything starts.

    asymptote sweep plan SPEC [--json]

``plan`` reads ``sweep.yaml`` (services/sweep/spec.py), resolves every arm
into the whole config its runs start from, checks that the machine can
place ``at_once`` runs, and prints the arms (what each changes from the
base), the seeds, the runs, the budget per arm and in all, and the planned
looks at which the rule judges the arms. A spec that is wrong is one line
naming what is wrong, exit 2, and nothing starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from asymptote.cli_args import ArgumentParser
from asymptote.compute import flops_text
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
    )


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="asymptote sweep", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    plan = sub.add_parser("plan", help="check a sweep spec and print its arms, runs, budget and looks")
    plan.add_argument("spec", type=Path, help="the sweep spec (sweep.yaml)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (every arm's whole config)")
    args = parser.parse_args(argv)
    spec, plans = planned(args.spec)
    if args.json:
        print(json.dumps(plan_json(spec, plans), indent=2))
    else:
        print_plan(spec, plans, Console())
    return 0
