"""``asymptote sweep replay``: the sweep rule run over finished runs, each cut at every planned look.

Owns calibrating the rule on runs that went to the end: what a sweep of these runs would have decided at
each look, against what their whole curves say. Runs are run directories (``eval.jsonl`` with each
held-out prompt's counts, ``metrics.jsonl``) or sweep folders (their ``runs/<arm>-s<seed>/run``); runs of
one arm (a sweep's seeds, or run directories given the same name with ``--arm``) are pooled as a sweep
pools them.

At each look (the spec's, or warm-up x sqrt(2)^k from the flags), every arm not yet stopped is cut at its
first round at or past the look (the runs side by side) and judged with the others (``rule.judge``); a
dominated or unstable arm stops there, and the compute its runs would not have spent is saved. Then each
arm is fitted on its whole curve to the budget:

- a false elimination is an arm stopped as dominated whose whole-curve A lies within the margin of the
  best whole-curve A, or above it;
- coverage is the share of (arm, look) intervals on A that hold the arm's whole-curve A.

Writes ``replay.json`` in ``--out``. Knows nothing of launchers or Optuna.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from asymptote.compute import flops_text
from asymptote.errors import ConfigError
from services.sweep.controller import atomic_write, eval_round, step_of
from services.sweep.rule import Arm, EvalRound, SweepSettings, fit_arm, judge, pool, prompt_draws

SEED_DIR = re.compile(r"^(?P<arm>.+)-s(?P<seed>\d+)$")


@dataclass(frozen=True)
class ReplayRun:
    """One finished run: its arm, its rounds (the step-0 round first) and its directory."""

    arm: str
    path: Path
    rounds: tuple[EvalRound, ...]


def read_run(run_dir: Path, arm: str, prompt_ids: Sequence[str] | None = None) -> tuple[ReplayRun, list[str]]:
    """The rounds of a finished run in compute order (a resumed run's re-evaluations dropped), and its
    held-out prompts; ConfigError when a row cannot be judged."""
    eval_path = run_dir / "eval.jsonl"
    if not eval_path.exists():
        raise ConfigError(f"{run_dir}: no eval.jsonl (give run directories, or sweep folders)")
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text(encoding="utf-8").splitlines() if metrics.exists() else []
    steps = [step_of(json.loads(line)) for line in lines if line.strip()]
    rounds: list[EvalRound] = []
    ids: list[str] | None = list(prompt_ids) if prompt_ids is not None else None
    last_version, last_compute = -1, -1.0
    for line in eval_path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if float(row["compute"]) <= last_compute:
            continue
        got = eval_round(row, steps, last_version, ids)
        if isinstance(got, str):
            raise ConfigError(f"{run_dir}: {got}")
        ids = ids or list(row["prompt_ids"])
        rounds.append(got)
        last_compute, last_version = got.compute, int(row.get("policy_version", row.get("step", last_version)))
    if not rounds or rounds[0].compute > 0:
        raise ConfigError(f"{run_dir}: no step-0 eval round (R0) to start its curve from")
    assert ids is not None
    return ReplayRun(arm, run_dir, tuple(rounds)), ids


def find_runs(paths: Sequence[Path], arms: Sequence[str] = ()) -> list[tuple[str, Path]]:
    """(arm, run directory) of each path: a sweep folder's runs by their ``<arm>-s<seed>`` names, a run
    directory by its ``--arm`` name (in order) or its own name."""
    found: list[tuple[str, Path]] = []
    names = list(arms)
    for path in paths:
        if (path / "eval.jsonl").exists():
            found.append((names.pop(0) if names else path.name, path))
        elif (path / "runs").is_dir():
            for run in sorted((path / "runs").iterdir()):
                match = SEED_DIR.match(run.name)
                if match and (run / "run" / "eval.jsonl").exists():
                    found.append((match["arm"], run / "run"))
        else:
            raise ConfigError(f"{path}: neither a run directory (eval.jsonl) nor a sweep folder (runs/)")
    if len({arm for arm, _ in found}) < 2:
        raise ConfigError("a replay compares at least 2 arms: give runs of two recipes or more")
    return found


def _upto(arm: Arm, look: float) -> Arm:
    at = min((r.compute for r in arm.rounds if r.compute >= look * (1 - 1e-9)), default=arm.compute)
    return Arm(arm.name, arm.baseline, tuple(r for r in arm.rounds if r.compute <= at * (1 + 1e-9)))


def replay(runs: Sequence[ReplayRun], settings: SweepSettings) -> dict[str, Any]:
    """The rule over ``runs`` at every planned look, against their whole curves (module docstring)."""
    by_arm: dict[str, list[Arm]] = {}
    for i, run in enumerate(runs):
        seed = Arm(f"{run.arm}#{i}", run.rounds[0], tuple(r for r in run.rounds[1:] if r.compute > 0))
        by_arm.setdefault(run.arm, []).append(_upto(seed, settings.budget_compute))
    draws = prompt_draws(runs[0].rounds[0].correct.size, settings)

    def fitted(name: str, seeds: list[Arm]) -> Any:
        return fit_arm(pool(name, seeds), settings, draws, seeds)

    whole = {name: fitted(name, seeds) for name, seeds in by_arm.items()}
    best = max((f.fit.a for f in whole.values() if f.fit is not None), default=None)
    stopped: dict[str, dict[str, Any]] = {}
    looks: list[dict[str, Any]] = []
    covered = intervals = 0
    for k, look in enumerate(settings.looks):
        alive = {name: [_upto(s, look) for s in seeds] for name, seeds in by_arm.items() if name not in stopped}
        fits = [fitted(name, seeds) for name, seeds in alive.items()]
        verdicts = judge(fits, settings, len(by_arm))
        for f in fits:
            full = whole[f.arm.name]
            if f.intervals is not None and full.fit is not None:
                intervals += 1
                covered += f.intervals.a.low <= full.fit.a <= f.intervals.a.high
        looks.append({"look": k, "compute": look, "outcomes": {n: v.outcome for n, v in verdicts.items()}})
        for name, verdict in verdicts.items():
            if verdict.stop:
                cut = [s.compute for s in alive[name]]
                stopped[name] = {
                    "look": k,
                    "look_compute": look,
                    "outcome": verdict.outcome,
                    "reason": verdict.reason,
                    "saved": sum(settings.budget_compute - c for c in cut),
                }
    arms: dict[str, dict[str, Any]] = {}
    false_eliminations = []
    for name, full in whole.items():
        stop = stopped.get(name)
        a = full.fit.a if full.fit is not None else None
        false = bool(
            stop is not None and stop["outcome"] == "dominated" and a is not None and best is not None
            and a >= best - settings.margin
        )  # fmt: skip
        if false:
            false_eliminations.append(name)
        arms[name] = {
            "seeds": len(by_arm[name]),
            "stopped": stop,
            "whole_curve": {
                "a": a,
                "a_interval": None if full.intervals is None else [full.intervals.a.low, full.intervals.a.high],
                "determined": bool(full.judged is not None and full.judged.determined),
                "why_not": full.unstable.text if full.unstable else full.why_not,
            },
            "false_elimination": false,
        }
    planned = sum(len(seeds) for seeds in by_arm.values()) * settings.budget_compute
    saved = sum(s["saved"] for s in stopped.values())
    return {
        "settings": settings.model_dump(mode="json"),
        "arms": arms,
        "looks": looks,
        "false_eliminations": false_eliminations,
        "compute_planned": planned,
        "compute_saved": saved,
        "compute_share": (planned - saved) / planned,
        "coverage": {"intervals": intervals, "covered": covered, "share": covered / intervals if intervals else None},
    }


def print_replay(report: dict[str, Any], console: Console) -> None:
    table = Table(title="replay: the rule at each look against the whole curves")
    for column in ("arm", "seeds", "stopped", "whole-curve A", "false elimination"):
        table.add_column(column)
    for name, arm in report["arms"].items():
        stop = arm["stopped"]
        shown = (
            "-" if stop is None else f"{stop['outcome']} at look {stop['look']} ({flops_text(stop['look_compute'])})"
        )
        whole = arm["whole_curve"]
        a = "-" if whole["a"] is None else f"{whole['a']:.3f}" + ("" if whole["determined"] else " not determined")
        table.add_row(name, str(arm["seeds"]), shown, a, "yes" if arm["false_elimination"] else "no")
    console.print(table)
    cov = report["coverage"]
    coverage = "no intervals" if cov["share"] is None else f"{cov['covered']}/{cov['intervals']} = {cov['share']:.2f}"
    console.print(
        f"false eliminations {len(report['false_eliminations'])}; compute {report['compute_share']:.0%} of every run "
        f"to its budget; A's intervals at the looks held the whole-curve A: {coverage}"
    )


def default_settings(runs: Sequence[ReplayRun], budget: float | None, warmup: float | None) -> SweepSettings:
    """The rule's settings without a spec: the budget the shortest run's compute unless given, the warm-up a
    tenth of the budget unless given."""
    budget = min(r.rounds[-1].compute for r in runs) if budget is None else budget
    warmup = budget / 10 if warmup is None else warmup
    if not 0 < warmup < budget:
        raise ConfigError(f"--warmup {warmup:g} must be above 0 and below the budget {budget:g}")
    return SweepSettings(warmup_compute=warmup, budget_compute=budget)


def main_replay(
    paths: Sequence[Path],
    out: Path,
    arms: Sequence[str] = (),
    settings: SweepSettings | None = None,
    budget: float | None = None,
    warmup: float | None = None,
) -> int:
    """Read the runs, replay them under ``settings`` (a spec's) or ``default_settings``, write replay.json."""
    found = find_runs(paths, arms)
    ids: list[str] | None = None
    runs = []
    for arm, path in found:
        run, ids = read_run(path, arm, ids)
        runs.append(run)
    report = replay(runs, settings or default_settings(runs, budget, warmup))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "replay.json", json.dumps(report, indent=2))
    print_replay(report, Console())
    return 0
