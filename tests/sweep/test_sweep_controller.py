"""The sweep controller's bookkeeping, on real files and real child processes.

Each run is a real subprocess (``fake_run.py``) that stands in for ``asymptote up`` for speed: it appends a
recorded curve's eval rows (per-prompt correct counts included) to its run directory's eval.jsonl at its own
pace, stops cleanly on SIGINT, and continues after its last row when resumed. The controller is driven by
``step()`` until an event, with a deadline; a "restart" is a new Controller on the same folder, the old one
dropped where it stood, as SIGKILL would leave it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asymptote.errors import ConfigError
from benchmarks.sweep import simulate_arms
from services.fitter.curve import CurveFitSettings
from services.sweep.controller import Controller
from services.sweep.launcher import LocalLauncher, RunPaths, process_start_ticks
from services.sweep.rule import Arm, SweepSettings
from services.sweep.spec import ArmPlan, SweepSpec, resolve

FAKE_RUN = Path(__file__).with_name("fake_run.py")
ROUNDS = np.arange(1, 41) / 40.0
SETTINGS = SweepSettings(
    warmup_compute=0.1, budget_compute=1.0, num_resamples=50, curve=CurveFitSettings(num_bootstrap_resamples=50)
)
DEADLINE_S = 20.0


def sweep_spec(arms: list[str], seeds: int = 1, at_once: int = 3) -> SweepSpec:
    variants = [{"name": name, "set": {"lr": 1e-4 * (i + 2)}} for i, name in enumerate(arms)]
    return SweepSpec.model_validate(
        {
            "arms": {"variants": variants},
            "include_base": False,
            "seeds": seeds,
            "budget": {"per_arm": 1.0},
            "warmup": 0.1,
            "at_once": at_once,
        }
    )


def rows_of(arm: Arm) -> list[dict[str, Any]]:
    """An arm's rounds as eval.jsonl rows, the step-0 round first."""
    rounds = (arm.baseline, *arm.rounds)
    return [
        {
            "step": i,
            "policy_version": i,
            "compute": r.compute,
            "pass_rate": r.pass_rate,
            "correct": r.correct.tolist(),
            "num_samples": r.num_samples,
            "unix_s": 0.0,
        }
        for i, r in enumerate(rounds)
    ]


def fake_launcher(directory: Path, curves: dict[str, dict[str, Any]]) -> LocalLauncher:
    """A launcher whose runs replay ``curves`` (by arm name) in fake_run.py processes."""
    directory.mkdir(parents=True, exist_ok=True)
    for arm, curve in curves.items():
        (directory / f"curve-{arm}.json").write_text(json.dumps(curve), encoding="utf-8")

    def command(run: RunPaths, resume: bool) -> list[str]:
        arm = run.name.rsplit("-s", 1)[0]
        target = ["--resume", str(run.run_dir)] if resume else ["--config", str(run.config)]
        return [sys.executable, str(FAKE_RUN), str(directory / f"curve-{arm}.json"), *target]

    return LocalLauncher(command)


def curves(a: list[float], names: list[str], interval_s: float, seed: int = 2) -> dict[str, dict[str, Any]]:
    arms = simulate_arms(a, [2.0] * len(a), [0.15] * len(a), np.random.default_rng(seed), ROUNDS)
    return {name: {"interval_s": interval_s, "rows": rows_of(arm)} for name, arm in zip(names, arms, strict=True)}


def controller(spec: SweepSpec, directory: Path, launcher: LocalLauncher, **kwargs: Any) -> Controller:
    return Controller(spec, resolve(spec), directory, launcher, settings=SETTINGS, **kwargs)


def drive(ctl: Controller, until: Callable[[], bool], check: Callable[[], None] = lambda: None) -> None:
    """Step ``ctl`` until ``until()`` holds, calling ``check`` after every step; fail past the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while not until():
        assert time.monotonic() < deadline, "the sweep did not get there in time"
        ctl.step()
        check()
        time.sleep(0.01)


def decisions(directory: Path) -> list[dict[str, Any]]:
    lines = (directory / "decisions.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def states(ctl: Controller) -> dict[str, str]:
    return {r.name: r.state for r in ctl.runs}


class KilledMidLook(Exception):
    """Stands for SIGKILL of the controller between logging a stop and carrying it out."""


def test_a_dominated_arm_is_stopped_at_a_look_once_across_a_restart_mid_look(tmp_path: Path) -> None:
    """Two arms of one recipe (A 0.68) and one far below (A 0.48). The controller dies after logging the
    stop of the low arm and before stopping it; the restarted one stops it, logs nothing twice, and
    completes the others at their budget with their fitted A."""
    spec = sweep_spec(["good", "twin", "low"])
    launcher = fake_launcher(tmp_path, curves([0.68, 0.68, 0.48], ["good", "twin", "low"], 0.06))
    first = controller(spec, tmp_path / "sweep", launcher)

    def dying_stop(run: RunPaths) -> None:
        raise KilledMidLook(run.name)

    launcher.stop = dying_stop  # type: ignore[method-assign]
    with pytest.raises(KilledMidLook):
        drive(first, lambda: False)
    logged = decisions(tmp_path / "sweep")
    assert [d["action"] for d in logged if d["run"] == "low-s0"][-1] == "stop"
    second = controller(spec, tmp_path / "sweep", fake_launcher(tmp_path, {}))
    drive(second, lambda: all(s in ("completed", "stopped") for s in states(second).values()))
    assert states(second) == {"good-s0": "completed", "twin-s0": "completed", "low-s0": "stopped"}
    after = decisions(tmp_path / "sweep")
    assert after[: len(logged)] == logged
    keys = [(d["run"], d["look"]) for d in after]
    assert len(keys) == len(set(keys))
    stop = next(d for d in after if d["action"] == "stop")
    assert stop["run"] == "low-s0" and stop["outcome"] == "dominated" and stop["look_compute"] < 1.0
    low = second.by_name["low-s0"]
    assert low.compute < 1.0 and low.starts == 1
    assert second.launcher.status(low.paths) == "exited"
    trials = {t.user_attrs["run"]: t for t in second.study.get_trials()}
    assert trials["low-s0"].state.name == "PRUNED"
    for name in ("good-s0", "twin-s0"):
        value = trials[name].value
        assert trials[name].state.name == "COMPLETE" and value is not None and abs(value - 0.68) < 0.06
    summary = json.loads((tmp_path / "sweep" / "sweep.json").read_text(encoding="utf-8"))
    low_arm = next(a for a in summary["arms"] if a["name"] == "low")
    assert low_arm["decision"] == "dominated" and low_arm["action"] == "stop" and "dominated by" in low_arm["why"]


def test_an_audit_sweep_stops_nothing_and_logs_what_the_rule_would_do(tmp_path: Path) -> None:
    spec = sweep_spec(["good", "low"])
    launcher = fake_launcher(tmp_path, curves([0.68, 0.48], ["good", "low"], 0.01))
    ctl = controller(spec, tmp_path / "sweep", launcher, audit=True)
    drive(ctl, lambda: all(s == "completed" for s in states(ctl).values()))
    assert all(r.compute == 1.0 for r in ctl.runs)
    logged = decisions(tmp_path / "sweep")
    assert "audit: would stop" in {d["action"] for d in logged if d["run"] == "low-s0"}
    assert "stop" not in {d["action"] for d in logged}


def test_a_restart_adopts_a_live_run_and_resumes_a_dead_one_whose_pid_was_reused(tmp_path: Path) -> None:
    """Two arms x two seeds, two at a time. The controller is dropped mid-sweep; one live run is killed and
    its pid record pointed at a live process of another start time (a reused pid). The new controller adopts
    the live run (same pid, one start) and resumes the dead one (two starts), never exceeds two runs at once,
    and every run's eval.jsonl holds each round once."""
    spec = sweep_spec(["one", "two"], seeds=2, at_once=2)
    launcher = fake_launcher(tmp_path, curves([0.6, 0.61], ["one", "two"], 0.01))
    directory = tmp_path / "sweep"

    def at_most_two() -> None:
        live = [r for r in ctl.runs if ctl.launcher.status(r.paths) == "running"]
        assert len(live) <= 2

    ctl = controller(spec, directory, launcher)
    drive(ctl, lambda: all(r.rounds >= 3 for r in ctl.runs[:2]), at_most_two)
    kept, killed = ctl.runs[0].paths, ctl.runs[1].paths
    kept_pid = json.loads(kept.process.read_text(encoding="utf-8"))["pid"]
    record = json.loads(killed.process.read_text(encoding="utf-8"))
    os.kill(record["pid"], signal.SIGKILL)
    ctl.launcher.close()  # the old controller's child is reaped as if init had it
    while process_start_ticks(record["pid"]) is not None:
        time.sleep(0.01)
    assert process_start_ticks(os.getpid()) != record["start_ticks"]
    killed.process.write_text(json.dumps({"pid": os.getpid(), "start_ticks": record["start_ticks"]}))
    ctl = controller(spec, directory, fake_launcher(tmp_path, {}))
    assert ctl.launcher.status(kept) == "running" and ctl.launcher.status(killed) == "exited"
    drive(ctl, lambda: all(s == "completed" for s in states(ctl).values()), at_most_two)
    assert json.loads(kept.process.read_text(encoding="utf-8"))["pid"] == kept_pid
    assert {r.name: r.starts for r in ctl.runs} == {"one-s0": 1, "two-s0": 2, "one-s1": 1, "two-s1": 1}
    for run in ctl.runs:
        computes = [json.loads(line)["compute"] for line in (run.paths.run_dir / "eval.jsonl").open()]
        assert computes == sorted(set(computes)) and len(computes) == ROUNDS.size + 1


def test_a_run_that_keeps_crashing_is_failed_with_its_reason_and_the_sweep_goes_on(tmp_path: Path) -> None:
    spec = sweep_spec(["good", "broken"])
    arms = curves([0.68, 0.66], ["good", "broken"], 0.01)
    arms["broken"]["crash_after"] = 4
    ctl = controller(spec, tmp_path / "sweep", fake_launcher(tmp_path, arms))
    drive(ctl, lambda: all(s in ("completed", "failed") for s in states(ctl).values()))
    broken = ctl.by_name["broken-s0"]
    assert states(ctl) == {"good-s0": "completed", "broken-s0": "failed"}
    assert broken.starts == 3 and "crashed 3 times" in broken.reason and "out of memory after 4 rows" in broken.reason
    summary = json.loads((tmp_path / "sweep" / "sweep.json").read_text(encoding="utf-8"))
    assert next(a for a in summary["arms"] if a["name"] == "broken")["runs"][0]["reason"] == broken.reason


def test_a_folder_holding_another_specs_sweep_is_refused_before_anything_starts(tmp_path: Path) -> None:
    launcher = fake_launcher(tmp_path, {})
    controller(sweep_spec(["one", "two"]), tmp_path / "sweep", launcher)
    other = sweep_spec(["one", "three"])
    plans: list[ArmPlan] = resolve(other)
    with pytest.raises(ConfigError, match="another spec"):
        Controller(other, plans, tmp_path / "sweep", launcher, settings=SETTINGS)
    assert not (tmp_path / "sweep" / "runs").exists()
