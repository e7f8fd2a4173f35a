"""The sweep's controller: runs a spec's runs, follows their eval rounds, and stops what cannot win.

Owns the bookkeeping of ``asymptote sweep run SPEC --dir DIR``, on Optuna's ask-and-tell interface:

- one trial per run (arm x seed; ``run``, ``arm`` and ``seed`` in its user attributes), in a study kept by
  Optuna's ``JournalStorage`` in ``DIR/study.journal``; the pruner is ``AsymptotePruner``, which pools the
  trials of one arm (its seeds) and judges arms, its error rate split over the spec's arms;
- at most ``at_once`` runs alive (``launcher.py``), all on one nats-server (``SharedNats``, its own prefix
  each) unless the runs name one; each live run's ``eval.jsonl`` is followed incrementally, and its
  ``metrics.jsonl`` for what the stops that are not about A read (the training truncation rate since the
  previous round, and whether every loss and gradient norm was finite); each new round is recorded and
  reported to its trial; when an arm passes a planned look its verdict is logged once, and a dominated or
  unstable arm's runs are stopped (``audit``: logged only); freed capacity starts the next pending run; a
  run at its budget is stopped and its trial told COMPLETE with its arm's fitted A;
- a run that dies below its budget is resumed (``up --resume``) up to ``max_starts`` starts in all, then
  its trial fails with the reason (the last line of its log).

Stops do not block: a run told to stop is settled in the study at once (PRUNED or COMPLETE) and counted
against ``at_once`` until its process is gone; the launcher escalates to SIGKILL past its grace.

Everything needed to restart is in DIR: ``spec.json`` (the spec and ``--audit`` it runs: another is
refused), the journal, ``runs/<run>/`` (config, process record, run directory), ``nats.json`` (the shared
server), and ``decisions.jsonl``, append-only, one row per (arm, look), never written twice. A restart
after SIGKILL replays the runs' eval rounds into a fresh pruner, adopts live runs and the live server,
resumes dead runs, and carries out logged stops it had not carried out. ``sweep.json`` is rewritten (temp
file and rename) after every change. Knows nothing of terminals.

Rows of ``eval.jsonl`` are judged only when they carry each held-out prompt's counts (``prompt_ids``,
``correct``, ``samples``, the same samples for every prompt), the prompts are the sweep's held-out set (the
first run's), and compute is on the FLOPs axis: the paired bootstrap needs the first two, comparing arms
needs all three. A run whose rows are not is reported to its trial (the pass rate at its step) and stays
undecided, saying why.
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
from pydantic import ValidationError

from asymptote.errors import ConfigError
from services.fitter.plot import PlotSeries, plot_curves
from services.sweep.launcher import Launcher, RunPaths, SharedNats
from services.sweep.pruner import ARM_ATTR, AsymptotePruner
from services.sweep.rule import ArmFit, EvalRound, SweepSettings, Verdict, choose, judge
from services.sweep.spec import ArmPlan, SweepSpec

log = logging.getLogger(__name__)

RunState = Literal["pending", "running", "completed", "stopped", "failed", "skipped"]
"""A run: not started, alive (or being restarted), at its budget, stopped by the rule, failed past its
restarts, or never started (its arm was stopped, or the sweep's total budget was spent)."""

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


Step = tuple[int, float, float, bool]
"""A training step of metrics.jsonl as the stops read it: (policy version, truncated, completions, finite)."""


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
    device_seconds: float = 0.0
    reason: str = ""
    starts: int = 0
    rounds: int = 0
    """Eval rounds past step 0 recorded."""
    rows_read: int = 0
    """Lines of its eval.jsonl read (re-evaluations of a resumed run included)."""
    not_judged: str = ""
    """Why its rounds cannot be judged (no per-prompt counts, other prompts, another axis); empty when they can."""
    offset: int = 0
    """Bytes of its eval.jsonl read so far."""
    metrics_offset: int = 0
    steps: list[Step] = field(default_factory=list)
    """Its training steps read from metrics.jsonl."""
    last_version: int = -1
    last_compute: float = -1.0
    closing: bool = False
    """Settled, and its process told to stop and not yet gone: it still holds its place."""


def _prefix(index: int, name: str) -> str:
    return f"sw{index}_{re.sub(r'[^a-z0-9]+', '_', name)}"


def _new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """The whole lines of ``path`` past byte ``offset``, and the offset after them (a line still being
    written is read next time); none while the file does not exist."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return data[:end].decode("utf-8").splitlines(), offset + end


def step_of(row: Mapping[str, Any]) -> Step:
    """One metrics.jsonl row as a ``Step``."""
    truncated = float(row.get("rollout/truncated", 0.0) or 0.0)
    completions = float(row.get("rollout/completions", 0.0) or 0.0)
    return int(row.get("policy_version", row.get("step", 0))), truncated, completions, _finite(row)


def eval_round(
    row: Mapping[str, Any], steps: Sequence[Step], after_version: int, prompt_ids: Sequence[str] | None
) -> EvalRound | str:
    """An eval.jsonl row as the rule reads it, with the training truncation rate and finiteness of ``steps``
    after ``after_version`` (the previous round's) up to its own version; or why it cannot be judged: no
    per-prompt counts, compute on another axis, prompts sampled unevenly, other prompts than
    ``prompt_ids`` (the sweep's held-out set; None: any)."""
    ids, correct, samples = row.get("prompt_ids"), row.get("correct"), row.get("samples")
    if ids is None or correct is None or samples is None:
        return "its eval rows carry no per-prompt counts"
    unit = row.get("compute_unit", "device_seconds")
    if unit != "flops":
        return f"its eval rows' compute is in {unit}, not FLOPs"
    if len(set(samples)) != 1:
        return f"its eval round at version {row.get('policy_version')} sampled prompts unevenly"
    if prompt_ids is not None and list(ids) != list(prompt_ids):
        return "its held-out prompts are not the sweep's (another eval set, or a round cut short)"
    compute = float(row["compute"])
    truncation, finite = None, True
    if compute > 0:
        version = int(row.get("policy_version", row.get("step", 0)))
        window = [s for s in steps if after_version < s[0] <= version]
        completions = sum(s[2] for s in window)
        truncation = sum(s[1] for s in window) / completions if completions > 0 else None
        finite = all(s[3] for s in window)
    return EvalRound(
        compute, np.asarray(correct, dtype=np.int64), int(samples[0]), truncation_rate=truncation, finite=finite
    )


def _finite(row: Mapping[str, Any]) -> bool:
    values = [row.get("loss"), row.get("optim/grad_norm")]
    return all(v is None or (isinstance(v, int | float) and math.isfinite(v)) for v in values)


class Controller:
    """The sweep in ``directory``: ``step()`` once per poll until it returns True (every run settled).

    ``nats``: the one nats-server every run shares (``SharedNats``), or None where the runs' configs name
    their own (``nats_url`` in the base) or start one each.
    """

    def __init__(
        self,
        spec: SweepSpec,
        plans: Sequence[ArmPlan],
        directory: Path,
        launcher: Launcher,
        *,
        audit: bool = False,
        nats: SharedNats | None = None,
        max_starts: int = MAX_STARTS,
        settings: SweepSettings | None = None,
    ) -> None:
        self.spec, self.plans, self.dir, self.launcher = spec, list(plans), directory, launcher
        self.audit, self.nats, self.max_starts = audit, nats, max_starts
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
            self.settings,
            num_arms=len(self.plans),
            compute_per_step=self.settings.budget_compute / STEPS_PER_BUDGET,
            seeds=spec.seeds,
        )
        self.study.pruner = self.pruner
        self.prompt_ids: list[str] | None = None
        """The sweep's held-out prompts: the first judged row's."""
        self.decisions_path = directory / "decisions.jsonl"
        self.decisions: dict[tuple[str, int], dict[str, Any]] = {}
        self._trials: dict[str, Trial] = {}
        self._load_decisions()
        self._load_trials()
        self.latest: dict[str, Any] = self.summary()
        """The summary last written to sweep.json (what the Prometheus export reads)."""

    # -- state in DIR -----------------------------------------------------------------------------------

    def _claim_directory(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        spec_file = self.dir / "spec.json"
        wanted = {"spec": self.spec.model_dump(mode="json"), "audit": self.audit}
        if spec_file.exists():
            held = json.loads(spec_file.read_text(encoding="utf-8"))
            # Read through today's model: a field added since, at its default, is the same spec.
            try:
                same = SweepSpec.model_validate(held.get("spec")) == self.spec
            except ValidationError:
                same = False
            if not same:
                raise ConfigError(
                    f"--dir {self.dir}: it holds the sweep of another spec (its spec.json differs); "
                    "give a new --dir, or the spec it was started with"
                )
            if held.get("audit") != self.audit:
                flag = "with" if held.get("audit") else "without"
                raise ConfigError(f"--dir {self.dir}: this sweep was started {flag} --audit; continue it the same way")
        else:
            atomic_write(spec_file, json.dumps(wanted, indent=2))

    def _load_decisions(self) -> None:
        if not self.decisions_path.exists():
            return
        for line in self.decisions_path.read_text(encoding="utf-8").splitlines():
            if line.endswith("}"):  # a row cut by SIGKILL mid-write has no closing brace
                row = json.loads(line)
                self.decisions[(row["arm"], row["look"])] = row

    def _load_trials(self) -> None:
        for frozen in self.study.get_trials(deepcopy=False):
            name = frozen.user_attrs.get("run")
            run = self.by_name.get(name) if isinstance(name, str) else None
            if run is None and isinstance(name, str):
                run = self._extra_run(str(frozen.user_attrs.get("arm")), int(frozen.user_attrs.get("seed", -1)))
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
            # Settled before the controller died, its process maybe still alive: stop it (again).
            run.closing = run.state != "running" and self.launcher.status(run.paths) == "running"
        for run in self.runs:
            if run.state == "pending" and self._arm_stopped(run.arm.name):
                run.state, run.reason = "skipped", "its arm was stopped"

    # -- eval rounds ------------------------------------------------------------------------------------

    def _trial(self, run: Run) -> Trial:
        assert run.trial is not None
        return self._trials[run.name]

    def _read_steps(self, run: Run) -> None:
        lines, run.metrics_offset = _new_lines(run.paths.run_dir / "metrics.jsonl", run.metrics_offset)
        run.steps.extend(step_of(json.loads(line)) for line in lines if line.strip())

    def _eval_round(self, run: Run, row: Mapping[str, Any]) -> EvalRound | None:
        """The row as the rule reads it, or None (and ``run.not_judged`` says why)."""
        got = eval_round(row, run.steps, run.last_version, self.prompt_ids)
        if isinstance(got, str):
            run.not_judged = got
            return None
        if self.prompt_ids is None:
            self.prompt_ids = list(row["prompt_ids"])
        return got

    def _read_rounds(self, run: Run) -> int:
        """Record the rows of ``run``'s eval.jsonl past what was read; the number of new rounds."""
        lines, run.offset = _new_lines(run.paths.run_dir / "eval.jsonl", run.offset)
        self._read_steps(run)
        trial = self._trial(run) if run.trial is not None else None
        new = 0
        for line in lines:
            if not line.strip():
                continue
            run.rows_read += 1
            row = json.loads(line)
            compute = float(row["compute"])
            if compute <= run.last_compute:  # a resumed run's re-evaluation of a round already seen
                continue
            run.compute = compute
            run.device_seconds = float(row.get("device_seconds") or 0.0)
            if trial is not None:
                new += 1
                eval_round = None if run.not_judged else self._eval_round(run, row)
                if eval_round is None:
                    if compute > 0:
                        self._report(trial, float(row["pass_rate"]), compute)
                else:
                    with warnings.catch_warnings():  # a replay after a restart reports steps the journal holds
                        warnings.simplefilter("ignore")
                        self.pruner.record(trial, eval_round)
                    run.rounds += compute > 0
            run.last_compute = compute
            run.last_version = int(row.get("policy_version", row.get("step", run.last_version)))
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
        self.decisions[(row["arm"], row["look"])] = row

    def _judge(self, plan: ArmPlan) -> None:
        """Ask the pruner about ``plan``'s arm through one of its live runs (it judges the arm, all its seeds
        pooled); log a new look's verdict once."""
        live = [r for r in self.runs if r.arm is plan and r.state == "running" and r.trial is not None and r.rounds]
        if not live:
            return
        before = self.pruner.looks_judged(plan.name)
        self._trial(live[0]).should_prune()
        due = self.pruner.looks_judged(plan.name)
        verdict = self.pruner.verdict(live[0].trial) if live[0].trial is not None else None
        if due <= before or verdict is None or (plan.name, due - 1) in self.decisions:
            return
        self._log_decision(self._decision_row(plan, due - 1, verdict))
        log.info("arm %s at look %d: %s", plan.name, due - 1, verdict.outcome)

    def _decision_row(self, plan: ArmPlan, look: int, verdict: Verdict) -> dict[str, Any]:
        diff = verdict.a_difference
        action = "continue"
        if verdict.stop:
            action = "audit: would stop" if self.audit else "stop"
        runs = [r for r in self.runs if r.arm is plan and r.rounds]
        return {
            "arm": plan.name,
            "look": look,
            "look_compute": self.settings.looks[look],
            "progress": self.pruner.progress([r.trial for r in runs if r.trial is not None]),
            "compute": max(r.compute for r in runs),
            "seeds": len(runs),
            "outcome": verdict.outcome,
            "reason": verdict.reason,
            "leader": verdict.leader,
            "a_difference": None if diff is None else [diff.low, diff.high],
            "alpha_look": self.settings.look_alpha(len(self.plans)),
            "seed_term": self._seed_term_text(plan, len(runs)),
            "action": action,
            "unix_s": time.time(),
        }

    def _seed_term_text(self, plan: ArmPlan, seeds: int) -> str:
        sd = self.settings.seed_sd_a
        if seeds < 2:
            return f"default {sd:g} (one seed)"
        return f"max(its {seeds} seeds' spread, default {sd:g}) / sqrt({seeds})"

    def _settle(self, run: Run, state: TrialState, reason: str, value: float | None = None) -> None:
        trial = self._trial(run)
        if run.trial is not None:
            for key, attr in {**self.pruner.user_attrs(run.trial), "reason": reason}.items():
                trial.set_user_attr(key, attr)
        self.study.tell(trial, value, state=state)
        run.state, run.reason = _STATE_OF[state], reason

    def _close(self, run: Run) -> None:
        """Tell a settled run's process to stop; it holds its place until it is gone."""
        run.closing = True
        self.launcher.stop(run.paths)

    def _apply_stops(self) -> bool:
        changed = False
        for d in list(self.decisions.values()):
            if d["action"] != "stop":
                continue
            for run in self.runs:
                if run.arm.name != d["arm"]:
                    continue
                if run.state == "running":
                    self._settle(run, TrialState.PRUNED, f"{d['outcome']} at look {d['look']}: {d['reason']}")
                    self._close(run)
                    changed = True
                elif run.state == "pending":
                    run.state, run.reason = "skipped", f"its arm was stopped: {d['outcome']}"
                    changed = True
        return changed

    # -- runs -------------------------------------------------------------------------------------------

    def _objective(self, run: Run) -> float | None:
        if run.trial is None:
            return None
        try:
            return self.pruner.objective_value(run.trial)
        except ValueError:
            return None

    def _nats_url(self) -> str | None:
        return None if self.nats is None else self.nats.ensure()

    def _start(self, run: Run) -> None:
        run.paths.root.mkdir(parents=True, exist_ok=True)
        url = self._nats_url() or run.arm.config.nats_url
        config = run.arm.run_config(run.seed, run.paths.run_dir, _prefix(run.index, run.name), url)
        # The fields given, as a user writes them (not less: a default-valued discriminator is still given).
        atomic_write(run.paths.config, yaml.safe_dump(config.model_dump(mode="json", exclude_unset=True)))
        if run.trial is None:
            trial = self.study.ask()
            attrs = {"run": run.name, ARM_ATTR: run.arm.name, "seed": run.seed, "starts": 0, "extra": run.reason}
            for key, value in attrs.items():
                trial.set_user_attr(key, value)
            run.trial = trial.number
            self._trials[run.name] = trial
        run.state = "running"
        self._launch(run, resume=False)

    def _launch(self, run: Run, resume: bool) -> None:
        if resume or run.starts:
            self._nats_url()  # the server the run's config names is up before it is
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
        """Follow one live run (its rounds read this poll); True when something changed."""
        if run.compute >= self.settings.budget_compute * (1 - 1e-9):
            self._judge(run.arm)
            if self._arm_stopped(run.arm.name):
                return True
            self._settle(run, TrialState.COMPLETE, "reached its budget", self._objective(run) or 0.0)
            self._close(run)
            return True
        status = self.launcher.status(run.paths)
        if status == "running":
            return False
        if status == "absent":  # named, then the controller died before it started the run
            self._launch(run, resume=False)
            return True
        self._read_rounds(run)  # what it wrote before it exited
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

    def _extra_run(self, arm: str, seed: int, why: str = "") -> Run | None:
        """A run of an extra seed of ``arm`` (LUCB), added to the sweep's runs; None for an arm not planned."""
        plan = next((p for p in self.plans if p.name == arm), None)
        if plan is None or seed < self.spec.seeds:
            return None
        name = f"{arm}-s{seed}"
        run = Run(name, plan, seed, len(self.runs), RunPaths(self.dir / "runs" / name), reason=why)
        self.runs.append(run)
        self.by_name[name] = run
        return run

    def _add_seeds(self) -> bool:
        """Spend free capacity on the leader and its closest challenger while the two are undecided: one
        more seed each, up to ``extra_seeds`` beyond the plan's, within the total budget. True when added."""
        verdicts = self.pruner.verdicts()
        leader = next((name for name, v in verdicts.items() if v.outcome == "leader"), None)
        if leader is None:
            return False
        undecided = [
            (abs(v.a_difference.low + v.a_difference.high), name)
            for name, v in verdicts.items()
            if v.outcome == "undecided" and v.leader == leader and v.a_difference is not None
            and not self._arm_stopped(name)
        ]  # fmt: skip
        if not undecided:
            return False
        challenger = min(undecided)[1]
        total = self.spec.budget.total
        planned = len(self.plans) * self.spec.seeds * self.settings.budget_compute if total is None else total
        added = False
        for arm, other in ((leader, challenger), (challenger, leader)):
            runs = [r for r in self.runs if r.arm.name == arm]
            if len(runs) >= self.spec.seeds + self.spec.extra_seeds or any(r.state == "pending" for r in runs):
                continue
            pending = sum(r.state == "pending" for r in self.runs)
            if self._committed() + (pending + 1) * self.settings.budget_compute > planned * (1 + 1e-9):
                return added
            why = f"extra seed: {arm} and {other} are undecided ({'leader' if arm == leader else 'closest challenger'})"
            self._extra_run(arm, max(r.seed for r in runs) + 1, why)
            log.info("%s", why)
            added = True
        return added

    def _committed(self) -> float:
        """Compute the started runs have spent or will spend: a live run's budget, a settled run's compute."""
        budget = self.settings.budget_compute
        return sum(budget if r.state == "running" else r.compute for r in self.runs if r.state != "pending")

    def step(self) -> bool:
        """One poll: carry out logged stops, follow live runs, judge arms at their looks, fill freed capacity,
        write sweep.json. True when every run has settled and every process is gone."""
        changed = self._apply_stops()
        for run in self.runs:
            if run.closing:
                if self.launcher.status(run.paths) == "running":
                    self.launcher.stop(run.paths)  # escalates to SIGKILL past the grace
                else:
                    run.closing, changed = False, True
        for run in self.runs:
            if run.state == "running":
                changed |= self._read_rounds(run) > 0
        for plan in self.plans:
            self._judge(plan)
        changed |= self._apply_stops()
        for run in self.runs:
            if run.state == "running":
                changed |= self._watch(run)
        alive = sum(r.state == "running" or r.closing for r in self.runs)
        if alive < self.spec.at_once and not any(r.state == "pending" for r in self.runs):
            changed |= self._add_seeds()
        total = self.spec.budget.total
        for run in self.runs:
            if alive >= self.spec.at_once:
                break
            if run.state != "pending":
                continue
            if total is not None and self._committed() + self.settings.budget_compute > total * (1 + 1e-9):
                run.state, run.reason = "skipped", "the sweep's total budget is spent"
            else:
                self._start(run)
                alive += 1
            changed = True
        done = all(r.state not in ("pending", "running") and not r.closing for r in self.runs)
        if changed or done or not (self.dir / "sweep.json").exists():
            self.write_summary(final=done)
        if done and self.nats is not None:
            self.nats.stop()
        return done

    # -- sweep.json -------------------------------------------------------------------------------------

    def final_verdicts(self) -> tuple[dict[str, ArmFit], dict[str, Verdict], str | None]:
        """Every arm fitted and judged on all its rounds (the arms the rule stopped too), and the arm the rule
        picks among those it did not stop: what the completed curves say, against which an audit's looks
        are read."""
        fits = self.pruner.fit_arms(self.study)
        if len(fits) < 2:
            return fits, {}, None
        verdicts = judge(list(fits.values()), self.settings, len(self.plans))
        stopped = {plan.name for plan in self.plans if self._arm_stopped(plan.name)}
        alive = [f for name, f in fits.items() if name not in stopped]
        return fits, verdicts, choose(alive, {k: v for k, v in verdicts.items() if k not in stopped})

    def _standing(self, arm: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Arm ``arm``'s first logged stop (or would-be stop), and the decision that stands: that stop, else
        its latest look's."""
        decided = sorted((d for d in self.decisions.values() if d["arm"] == arm), key=lambda d: d["look"])
        stop = next((d for d in decided if d["action"] != "continue"), None)
        return stop, stop or (decided[-1] if decided else None)

    def plot(self, fits: Mapping[str, ArmFit], path: Path) -> Path | None:
        """Every arm's points, pooled fit and A interval in one PNG (the fitter's curve plot), each labelled
        with the decision that stands; None before any arm has a round."""
        series = []
        for plan in self.plans:
            fitted = fits.get(plan.name)
            if fitted is None:
                continue
            _, shown = self._standing(plan.name)
            label = plan.name if shown is None else f"{plan.name} ({shown['outcome']}, look {shown['look']})"
            rounds = fitted.arm.rounds
            # A fit without its intervals (too few points to bootstrap) is drawn as points, saying why.
            whole = fitted.intervals is not None
            if not whole:
                label += f": {fitted.unstable.text if fitted.unstable else fitted.why_not or 'no fit'}"
            series.append(
                PlotSeries(
                    label,
                    [r.compute for r in rounds],
                    [r.pass_rate for r in rounds],
                    fitted.fit if whole else None,
                    fitted.intervals,
                    fitted.judged,
                )
            )
        if not series:
            return None
        seeds = f"{self.spec.seeds} seed{'s' if self.spec.seeds > 1 else ''}"
        title = f"sweep{' (audit)' if self.audit else ''}: {len(self.plans)} arms x {seeds}"
        return plot_curves(series, path, target_compute=self.settings.budget_compute, title=title)

    def summary(self, final: bool = False) -> dict[str, Any]:
        """Every arm: its overrides, seeds, compute, runs, fit, decision and why; at the end, the completed
        curves' verdicts, the pick, and (audit) whether each logged stop was borne out."""
        fits, verdicts, pick = self.final_verdicts() if final else ({}, {}, None)
        arms = []
        for plan in self.plans:
            runs = [r for r in self.runs if r.arm is plan]
            stop, shown = self._standing(plan.name)
            states = {r.state for r in runs}
            fit = next((self.pruner.user_attrs(r.trial) for r in runs if r.trial is not None), None)
            entry: dict[str, Any] = {
                "name": plan.name,
                "overrides": plan.overrides,
                "seeds": [r.seed for r in runs],
                "status": next(
                    s for s in ("running", "pending", "stopped", "failed", "completed", "skipped") if s in states
                ),
                "compute": sum(r.compute for r in runs),
                "device_seconds": sum(r.device_seconds for r in runs),
                "fit": None if fit is None or fit["a"] is None else fit,
                "runs": [self._run_summary(r) for r in runs],
                "decision": None if shown is None else shown["outcome"],
                "action": None if shown is None else shown["action"],
                "why": None if shown is None else shown["reason"],
            }
            if final and plan.name in verdicts:
                final_verdict = verdicts[plan.name]
                whole = fits[plan.name]
                entry["final"] = {
                    "outcome": final_verdict.outcome,
                    "reason": final_verdict.reason,
                    "a": None if whole.fit is None else whole.fit.a,
                    "a_interval": None if whole.intervals is None else [whole.intervals.a.low, whole.intervals.a.high],
                    "determined": bool(whole.judged is not None and whole.judged.determined),
                }
                if stop is not None:
                    entry["borne_out"] = final_verdict.outcome in ("dominated", "unstable")
            arms.append(entry)
        runs_total = len(self.runs) * self.settings.budget_compute
        spent = sum(r.compute for r in self.runs)
        saved = sum(self.settings.budget_compute - r.compute for r in self.runs if r.state in ("stopped", "skipped"))
        counts: dict[str, int] = {}
        for d in self.decisions.values():
            counts[d["outcome"]] = counts.get(d["outcome"], 0) + 1
        out: dict[str, Any] = {
            "audit": self.audit,
            "budget_per_arm": self.spec.budget.per_arm,
            "looks": list(self.settings.looks),
            "alpha_look": self.settings.look_alpha(len(self.plans)),
            "compute": spent,
            "compute_share": spent / runs_total if runs_total > 0 else None,
            "compute_by_kind": {"spent": spent, "planned": runs_total, "saved": max(saved, 0.0)},
            "decision_counts": counts,
            "device_seconds": sum(r.device_seconds for r in self.runs),
            "arms": arms,
        }
        if final:
            out["pick"] = pick
        return out

    def _run_summary(self, run: Run) -> dict[str, Any]:
        return {
            "run": run.name,
            "seed": run.seed,
            "status": run.state,
            "trial": run.trial,
            "starts": run.starts,
            "compute": run.compute,
            "device_seconds": run.device_seconds,
            "reason": run.reason or (f"not judged: {run.not_judged}" if run.not_judged else None),
        }

    def write_summary(self, final: bool = False) -> None:
        """sweep.json, and at the end sweep.png: every arm's whole curve."""
        self.latest = self.summary(final)
        atomic_write(self.dir / "sweep.json", json.dumps(self.latest, indent=2))
        if final:
            self.plot(self.pruner.fit_arms(self.study), self.dir / "sweep.png")


def read_summary(directory: Path) -> Mapping[str, Any]:
    """A sweep's ``sweep.json``."""
    loaded: Mapping[str, Any] = json.loads((directory / "sweep.json").read_text(encoding="utf-8"))
    return loaded
