"""The sweep's controller: runs a spec's runs, follows their eval rounds, and stops what cannot win.

Owns the bookkeeping of ``asymptote sweep run SPEC --dir DIR``, on Optuna's ask-and-tell interface:

- one trial per run (arm x seed; ``run``, ``arm`` and ``seed`` in its user attributes), in a study kept by
  Optuna's ``JournalStorage`` in ``DIR/study.journal``; the pruner is ``AsymptotePruner``, which judges
  each run as one of the study's arms;
- at most ``at_once`` runs alive (``launcher.py``); each live run's ``eval.jsonl`` is followed
  incrementally, each new round recorded and reported to its trial; at each planned look the pruner's
  verdict is logged, and a dominated or unstable arm's runs are stopped (``audit``: logged only); freed
  capacity starts the next pending run; a run at its budget is stopped and its trial told COMPLETE with
  its fitted A;
- a run that dies below its budget is resumed (``up --resume``) up to ``max_starts`` starts in all, then
  its trial fails with the reason (the last line of its log).

Everything needed to restart is in DIR: ``spec.json`` (the spec it runs: another spec is refused), the
journal, ``runs/<run>/`` (config, process record, run directory), and ``decisions.jsonl``, append-only,
one row per (run, look), never written twice. A restart after SIGKILL replays the runs' eval rounds into a
fresh pruner, adopts live runs, resumes dead ones, and applies logged stops it had not applied yet.
``sweep.json`` is rewritten (temp file and rename) after every change. Knows nothing of terminals.

Rows of ``eval.jsonl`` are judged only when they carry each held-out prompt's correct count (``correct``,
a list, with ``num_samples``): the paired bootstrap needs them. Rows without are reported to the trial
(its pass rate at its step) and the arm stays undecided, saying why.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import optuna
import yaml
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import Trial, TrialState

from asymptote.errors import ConfigError
from services.sweep.launcher import Launcher, RunPaths
from services.sweep.pruner import AsymptotePruner
from services.sweep.rule import EvalRound, SweepSettings
from services.sweep.spec import ArmPlan, SweepSpec

log = logging.getLogger(__name__)

RunState = Literal["pending", "running", "completed", "stopped", "failed", "skipped"]
"""A run: not started, alive (or being restarted), at its budget, stopped by the rule, failed past its
restarts, or never started because its arm was stopped."""

MAX_STARTS = 3
"""Starts of one run (the first and its restarts) before a run that keeps dying is marked failed."""
STEPS_PER_BUDGET = 10_000
"""Optuna steps in one arm's budget: the compute axis in integer units."""
STUDY_NAME = "sweep"
_STATE_OF: dict[TrialState, RunState] = {
    TrialState.RUNNING: "running",
    TrialState.COMPLETE: "completed",
    TrialState.PRUNED: "stopped",
    TrialState.FAIL: "failed",
}


def atomic_write(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temp file beside it, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@dataclass
class Run:
    """One run of the sweep as the controller tracks it."""

    name: str
    arm: ArmPlan
    seed: int
    index: int
    paths: RunPaths
    state: RunState = "pending"
    trial: int | None = None
    compute: float = 0.0
    reason: str = ""
    starts: int = 0
    rounds: int = 0
    counts: bool = True
    """Its eval rows carry per-prompt counts (judged); False once a row without them arrived."""
    offset: int = 0
    """Bytes of its eval.jsonl read so far."""
    last_compute: float = -1.0
    judged_looks: int = 0
    attrs: dict[str, Any] = field(default_factory=dict)


def _prefix(index: int, name: str) -> str:
    return f"sw{index}_{re.sub(r'[^a-z0-9]+', '_', name)}"


class Controller:
    """The sweep in ``directory``: ``step()`` once per poll until it returns True (every run settled)."""

    def __init__(
        self,
        spec: SweepSpec,
        plans: Sequence[ArmPlan],
        directory: Path,
        launcher: Launcher,
        *,
        audit: bool = False,
        nats_url: str | None = None,
        max_starts: int = MAX_STARTS,
        settings: SweepSettings | None = None,
    ) -> None:
        self.spec, self.plans, self.dir, self.launcher = spec, list(plans), directory, launcher
        self.audit, self.nats_url, self.max_starts = audit, nats_url, max_starts
        self.settings = spec.settings if settings is None else settings
        self._claim_directory()
        self.runs: list[Run] = []
        for seed in range(spec.seeds):  # seed-major: every arm has a run before any has two
            for plan in self.plans:
                name = f"{plan.name}-s{seed}"
                self.runs.append(Run(name, plan, seed, len(self.runs), RunPaths(directory / "runs" / name)))
        self.by_name = {r.name: r for r in self.runs}
        storage = JournalStorage(JournalFileBackend(str(directory / "study.journal")))
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = optuna.create_study(
            study_name=STUDY_NAME, storage=storage, direction="maximize", load_if_exists=True
        )
        self.pruner = AsymptotePruner(
            self.settings, num_arms=len(self.runs), compute_per_step=spec.budget.per_arm / STEPS_PER_BUDGET
        )
        self.study.pruner = self.pruner
        self.decisions_path = directory / "decisions.jsonl"
        self.decisions: dict[tuple[str, int], dict[str, Any]] = {}
        self._trials: dict[str, Trial] = {}
        self._load_decisions()
        self._load_trials()

    # -- state in DIR -----------------------------------------------------------------------------------

    def _claim_directory(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        spec_file = self.dir / "spec.json"
        wanted = self.spec.model_dump(mode="json")
        if spec_file.exists():
            held = json.loads(spec_file.read_text(encoding="utf-8"))
            if held != wanted:
                raise ConfigError(
                    f"--dir {self.dir}: it holds the sweep of another spec (its spec.json differs); "
                    "give a new --dir, or the spec it was started with"
                )
        else:
            atomic_write(spec_file, json.dumps(wanted, indent=2))

    def _load_decisions(self) -> None:
        if not self.decisions_path.exists():
            return
        for line in self.decisions_path.read_text(encoding="utf-8").splitlines():
            if line.endswith("}"):  # a row cut by SIGKILL mid-write has no closing brace
                row = json.loads(line)
                self.decisions[(row["run"], row["look"])] = row

    def _load_trials(self) -> None:
        for frozen in self.study.get_trials(deepcopy=False):
            name = frozen.user_attrs.get("run")
            run = self.by_name.get(name) if isinstance(name, str) else None
            if run is None:
                if frozen.state == TrialState.RUNNING:
                    # Asked, then the controller died before it named the trial's run: no run started.
                    self.study.tell(frozen.number, state=TrialState.FAIL)
                continue
            run.trial, run.starts = frozen.number, int(frozen.user_attrs.get("starts", 0))
            # Ask-and-tell's handle on a trial of the journal: Optuna has no public way to rebuild one.
            self._trials[run.name] = Trial(self.study, frozen._trial_id)
            run.reason = str(frozen.user_attrs.get("reason", ""))
            run.state = _STATE_OF.get(frozen.state, "failed")
            self._read_rounds(run)
        for run in self.runs:
            if run.state == "pending" and self._arm_stopped(run.arm.name):
                run.state = "skipped"

    # -- eval rounds ------------------------------------------------------------------------------------

    def _trial(self, run: Run) -> Trial:
        assert run.trial is not None
        return self._trials[run.name]

    def _read_rounds(self, run: Run) -> int:
        """Record the rows of ``run``'s eval.jsonl past what was read; the number of new rounds."""
        path = run.paths.run_dir / "eval.jsonl"
        try:
            with path.open("rb") as handle:
                handle.seek(run.offset)
                data = handle.read()
        except FileNotFoundError:
            return 0
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        run.offset += end
        trial = self._trial(run) if run.trial is not None else None
        new = 0
        for line in data[:end].decode("utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            compute = float(row["compute"])
            if compute <= run.last_compute:  # a resumed run's re-evaluation of a round already seen
                continue
            run.last_compute, run.compute = compute, compute
            if trial is None:
                continue
            new += 1
            correct = row.get("correct")
            if correct is None or not run.counts:
                run.counts = False
                if compute > 0:
                    self._report(trial, float(row["pass_rate"]), compute)
                continue
            eval_round = EvalRound(
                compute,
                np.asarray(correct, dtype=np.int64),
                int(row["num_samples"]),
                truncation_rate=row.get("truncation_rate"),
                finite=bool(row.get("finite", True)),
            )
            with warnings.catch_warnings():  # a replay after a restart reports steps the journal holds
                warnings.simplefilter("ignore")
                self.pruner.record(trial, eval_round)
            run.rounds += eval_round.compute > 0
        return new

    def _report(self, trial: Trial, value: float, compute: float) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial.report(value, self.pruner.step(compute))

    # -- decisions --------------------------------------------------------------------------------------

    def _arm_stopped(self, arm: str) -> bool:
        return any(d["arm"] == arm and d["action"] == "stop" for d in self.decisions.values())

    def _log_decision(self, row: dict[str, Any]) -> None:
        with self.decisions_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.decisions[(row["run"], row["look"])] = row

    def _judge(self, run: Run) -> None:
        """Ask the pruner about ``run`` at a planned look it has newly passed; log the verdict once."""
        if run.rounds == 0 or run.trial is None:
            return
        looks = self.settings.looks
        due = sum(look <= run.compute * (1 + 1e-9) for look in looks)
        if due <= run.judged_looks:
            return
        run.judged_looks = due
        self._trial(run).should_prune()
        verdict = self.pruner.verdict(run.trial)
        run.attrs = self.pruner.user_attrs(run.trial)
        key = (run.name, due - 1)
        if verdict is None or key in self.decisions:
            return
        diff = verdict.a_difference
        action = "continue"
        if verdict.stop:
            action = "audit: would stop" if self.audit else "stop"
        self._log_decision(
            {
                "run": run.name,
                "arm": run.arm.name,
                "look": due - 1,
                "look_compute": looks[due - 1],
                "compute": run.compute,
                "outcome": verdict.outcome,
                "reason": verdict.reason,
                "leader": verdict.leader,
                "a_difference": None if diff is None else [diff.low, diff.high],
                "alpha_look": self.settings.look_alpha(len(self.runs)),
                "action": action,
                "unix_s": time.time(),
            }
        )
        log.info("%s at look %d: %s (%s)", run.name, due - 1, verdict.outcome, action)

    def _settle(self, run: Run, state: TrialState, reason: str, value: float | None = None) -> None:
        trial = self._trial(run)
        for key, attr in {**run.attrs, "reason": reason}.items():
            trial.set_user_attr(key, attr)
        self.study.tell(trial, value, state=state)
        run.state, run.reason = _STATE_OF[state], reason

    def _apply_stops(self) -> None:
        for d in list(self.decisions.values()):
            if d["action"] != "stop":
                continue
            for run in self.runs:
                if run.arm.name != d["arm"]:
                    continue
                if run.state == "running":
                    self.launcher.stop(run.paths)
                    self._settle(run, TrialState.PRUNED, f"{d['outcome']} at look {d['look']}: {d['reason']}")
                elif run.state == "pending":
                    run.state, run.reason = "skipped", f"its arm was stopped: {d['outcome']}"

    # -- runs -------------------------------------------------------------------------------------------

    def _objective(self, run: Run) -> float | None:
        if run.trial is None:
            return None
        try:
            return self.pruner.objective_value(run.trial)
        except ValueError:
            return None

    def _start(self, run: Run) -> None:
        run.paths.root.mkdir(parents=True, exist_ok=True)
        config = run.arm.run_config(run.seed, run.paths.run_dir, _prefix(run.index, run.name), self.nats_url)
        atomic_write(run.paths.config, yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
        if run.trial is None:
            trial = self.study.ask()
            for key, value in {"run": run.name, "arm": run.arm.name, "seed": run.seed, "starts": 0}.items():
                trial.set_user_attr(key, value)
            run.trial = trial.number
            self._trials[run.name] = trial
        run.state = "running"
        self._launch(run, resume=False)

    def _launch(self, run: Run, resume: bool) -> None:
        run.starts += 1
        self._trial(run).set_user_attr("starts", run.starts)  # before the start: a start is never uncounted
        (self.launcher.resume if resume else self.launcher.start)(run.paths)

    def _last_log_line(self, run: Run) -> str:
        try:
            lines = [ln for ln in run.paths.log.read_text(encoding="utf-8", errors="replace").splitlines() if ln]
        except FileNotFoundError:
            return "no output"
        return lines[-1][:300] if lines else "no output"

    def _watch(self, run: Run) -> bool:
        """Follow one live run; True when something changed."""
        changed = self._read_rounds(run) > 0
        self._judge(run)
        if self._arm_stopped(run.arm.name):
            return True
        if run.compute >= self.settings.budget_compute * (1 - 1e-9):
            self.launcher.stop(run.paths)
            self._settle(run, TrialState.COMPLETE, "reached its budget", self._objective(run) or 0.0)
            return True
        status = self.launcher.status(run.paths)
        if status == "running":
            return changed
        if status == "absent":  # named, then the controller died before it started the run
            self._launch(run, resume=False)
            return True
        self._read_rounds(run)
        summary = run.paths.run_dir / "summary.json"
        ended = summary.exists() and summary.stat().st_mtime >= run.paths.process.stat().st_mtime
        if ended:
            value = self._objective(run)
            self._settle(
                run,
                TrialState.COMPLETE,
                f"the run ended by itself at compute {run.compute:.4g}, below its budget",
                value if value is not None else 0.0,
            )
        elif run.starts >= self.max_starts:
            self._settle(run, TrialState.FAIL, f"crashed {run.starts} times; last: {self._last_log_line(run)}")
        else:
            log.warning("run %s died (start %d); resuming it", run.name, run.starts)
            # A run that died before its stack.json has nothing to resume: it starts again from its config.
            self._launch(run, resume=(run.paths.run_dir / "stack.json").exists())
        return True

    def step(self) -> bool:
        """One poll: apply logged stops, follow live runs, fill freed capacity, write sweep.json. True when
        every run has settled."""
        self._apply_stops()
        changed = False
        for run in self.runs:
            if run.state == "running":
                changed |= self._watch(run)
        self._apply_stops()
        alive = sum(r.state == "running" for r in self.runs)
        for run in self.runs:
            if alive >= self.spec.at_once:
                break
            if run.state == "pending":
                self._start(run)
                alive += 1
                changed = True
        if changed or not (self.dir / "sweep.json").exists():
            self.write_summary()
        return all(r.state not in ("pending", "running") for r in self.runs)

    # -- sweep.json -------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Every arm: its overrides, seeds, compute, runs (each with its latest fit), decision and why."""
        arms = []
        for plan in self.plans:
            runs = [r for r in self.runs if r.arm is plan]
            decided = [d for d in self.decisions.values() if d["arm"] == plan.name]
            latest = max(decided, key=lambda d: (d["look"], d["unix_s"]), default=None)
            stop = next((d for d in decided if d["action"] != "continue"), None)
            shown = stop or latest
            states = {r.state for r in runs}
            arms.append(
                {
                    "name": plan.name,
                    "overrides": plan.overrides,
                    "seeds": [r.seed for r in runs],
                    "status": next(
                        s for s in ("running", "pending", "stopped", "failed", "completed", "skipped") if s in states
                    ),
                    "compute": sum(r.compute for r in runs),
                    "runs": [self._run_summary(r) for r in runs],
                    "decision": None if shown is None else shown["outcome"],
                    "action": None if shown is None else shown["action"],
                    "why": None if shown is None else shown["reason"],
                }
            )
        return {
            "audit": self.audit,
            "budget_per_arm": self.spec.budget.per_arm,
            "looks": list(self.settings.looks),
            "compute": sum(r.compute for r in self.runs),
            "arms": arms,
        }

    def _run_summary(self, run: Run) -> dict[str, Any]:
        attrs = run.attrs
        a = attrs.get("a")
        return {
            "run": run.name,
            "seed": run.seed,
            "status": run.state,
            "trial": run.trial,
            "starts": run.starts,
            "compute": run.compute,
            "reason": run.reason or (None if run.counts else "its eval rows carry no per-prompt counts: not judged"),
            "fit": None
            if a is None or not math.isfinite(float(a))
            else {k: attrs.get(k) for k in ("a", "a_low", "a_high", "b", "c_mid", "determined")},
        }

    def write_summary(self) -> None:
        atomic_write(self.dir / "sweep.json", json.dumps(self.summary(), indent=2))


def read_summary(directory: Path) -> Mapping[str, Any]:
    """A sweep's ``sweep.json``."""
    loaded: Mapping[str, Any] = json.loads((directory / "sweep.json").read_text(encoding="utf-8"))
    return loaded
