"""The sweep controller's bookkeeping, on real files, real child processes and a real nats-server.

Each run is a real subprocess (``fake_run.py``) that stands in for ``asymptote up`` for speed: it appends a
recorded curve's eval rows (each held-out prompt's counts included, on the FLOPs axis) and training steps to
its run directory as far as the test releases them, stops cleanly on SIGTERM, and continues after its last
row when resumed. The driver releases one more row to a run only once the controller has read all it was
given, so every run's rows reach the controller one at a time whatever the machine's pace. A "restart" is a
new Controller on the same folder, the old one dropped where it stood, as SIGKILL would leave it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from asymptote.config import load_config
from asymptote.errors import ConfigError
from asymptote.nats_local import free_port
from benchmarks.sweep import simulate_arms
from services.fitter.curve import CurveFitSettings
from services.local.config import StackConfig
from services.sweep.controller import Controller
from services.sweep.launcher import LocalLauncher, RunPaths, SharedNats, process_start_ticks
from services.sweep.metrics import SweepCollector
from services.sweep.rule import Arm, SweepSettings
from services.sweep.spec import ArmPlan, SweepSpec, resolve

FAKE_RUN = Path(__file__).with_name("fake_run.py")
ROUNDS = np.arange(1, 41) / 40.0
SETTINGS = SweepSettings(
    warmup_compute=0.1, budget_compute=1.0, num_resamples=50, curve=CurveFitSettings(num_bootstrap_resamples=50)
)
DEADLINE_S = 120.0


def sweep_spec(arms: list[str], seeds: int = 1, at_once: int = 3, **more: Any) -> SweepSpec:
    variants = [{"name": name, "set": {"lr": 1e-4 * (i + 2)}} for i, name in enumerate(arms)]
    return SweepSpec.model_validate(
        {
            "arms": {"variants": variants},
            "include_base": False,
            "seeds": seeds,
            "budget": {"per_arm": 1.0},
            "warmup": 0.1,
            "at_once": at_once,
            "extra_seeds": 0,
            **more,
        }
    )


def rows_of(arm: Arm) -> list[dict[str, Any]]:
    """An arm's rounds as eval.jsonl rows, the step-0 round first."""
    rounds = (arm.baseline, *arm.rounds)
    ids = [f"p{i:04d}" for i in range(arm.baseline.correct.size)]
    return [
        {
            "step": i,
            "policy_version": i,
            "compute": r.compute,
            "compute_unit": "flops",
            "pass_rate": r.pass_rate,
            "num_prompts": r.correct.size,
            "num_samples": r.correct.size * r.num_samples,
            "prompt_ids": ids,
            "correct": r.correct.tolist(),
            "samples": [r.num_samples] * r.correct.size,
            "unix_s": 0.0,
        }
        for i, r in enumerate(rounds)
    ]


def steps_of(num_rows: int, truncation: float) -> list[dict[str, Any]]:
    """A training step before each eval row (metrics.jsonl rows): 100 completions, ``truncation`` of them cut."""
    return [
        {
            "step": i,
            "policy_version": i,
            "rollout/completions": 100.0,
            "rollout/truncated": 100.0 * truncation,
            "loss": 0.01,
            "optim/grad_norm": 0.5,
        }
        for i in range(num_rows)
    ]


def fake_launcher(directory: Path, curves: dict[str, dict[str, Any]], grace_s: float = 30.0) -> LocalLauncher:
    """A launcher whose runs replay ``curves`` (by arm name) in fake_run.py processes."""
    directory.mkdir(parents=True, exist_ok=True)
    for arm, curve in curves.items():
        (directory / f"curve-{arm}.json").write_text(json.dumps(curve), encoding="utf-8")

    def command(run: RunPaths, resume: bool) -> list[str]:
        arm = run.name.rsplit("-s", 1)[0]
        target = ["--resume", str(run.run_dir)] if resume else ["--config", str(run.config)]
        own = directory / f"curve-{run.name}.json"  # a seed's own curve, else its arm's
        curve = own if own.exists() else directory / f"curve-{arm}.json"
        return [sys.executable, str(FAKE_RUN), str(curve), *target]

    return LocalLauncher(command, grace_s=grace_s)


def curves(a: list[float], names: list[str], seed: int = 2) -> dict[str, dict[str, Any]]:
    arms = simulate_arms(a, [2.0] * len(a), [0.15] * len(a), np.random.default_rng(seed), ROUNDS)
    return {name: {"rows": rows_of(arm)} for name, arm in zip(names, arms, strict=True)}


def controller(spec: SweepSpec, directory: Path, launcher: LocalLauncher, **kwargs: Any) -> Controller:
    return Controller(spec, resolve(spec), directory, launcher, settings=SETTINGS, **kwargs)


def released(run: RunPaths) -> int:
    path = run.root / "release"
    return int(path.read_text(encoding="utf-8")) if path.exists() else 0


def drive(ctl: Controller, until: Callable[[], bool], check: Callable[[], None] = lambda: None) -> None:
    """Step ``ctl`` until ``until()`` holds, calling ``check`` after every step, releasing one more row to
    each live run that the controller has read up to; fail past the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while not until():
        assert time.monotonic() < deadline, "the sweep did not get there in time"
        ctl.step()
        check()
        for run in ctl.runs:
            if run.state == "running" and run.paths.root.exists() and run.rows_read >= released(run.paths):
                (run.paths.root / "release").write_text(str(run.rows_read + 1), encoding="utf-8")
        time.sleep(0.005)


def decisions(directory: Path) -> list[dict[str, Any]]:
    lines = (directory / "decisions.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def states(ctl: Controller) -> dict[str, str]:
    return {r.name: r.state for r in ctl.runs}


def settled(ctl: Controller) -> bool:
    return all(r.state not in ("pending", "running") and not r.closing for r in ctl.runs)


class KilledMidLook(Exception):
    """Stands for SIGKILL of the controller between logging a stop and carrying it out."""


def test_a_dominated_arm_is_stopped_at_a_look_once_across_a_restart_mid_look(tmp_path: Path) -> None:
    """Two arms of one recipe (A 0.68) and one far below (A 0.48). The controller dies after logging the
    stop of the low arm and before stopping it; the restarted one stops it, logs nothing twice, and
    completes the others at their budget with their fitted A."""
    spec = sweep_spec(["good", "twin", "low"])
    launcher = fake_launcher(tmp_path, curves([0.68, 0.68, 0.48], ["good", "twin", "low"]))
    first = controller(spec, tmp_path / "sweep", launcher)

    def dying_stop(run: RunPaths) -> None:
        raise KilledMidLook(run.name)

    launcher.stop = dying_stop  # type: ignore[method-assign]
    with pytest.raises(KilledMidLook):
        drive(first, lambda: False)
    logged = decisions(tmp_path / "sweep")
    assert [d["action"] for d in logged if d["arm"] == "low"][-1] == "stop"
    second = controller(spec, tmp_path / "sweep", fake_launcher(tmp_path, {}))
    drive(second, lambda: settled(second))
    assert states(second) == {"good-s0": "completed", "twin-s0": "completed", "low-s0": "stopped"}
    after = decisions(tmp_path / "sweep")
    assert after[: len(logged)] == logged
    keys = [(d["arm"], d["look"]) for d in after]
    assert len(keys) == len(set(keys))
    stop = next(d for d in after if d["action"] == "stop")
    assert stop["arm"] == "low" and stop["outcome"] == "dominated" and stop["look_compute"] < 1.0
    # Bonferroni over the 3 arms and 7 looks, each a one-sided comparison.
    assert stop["alpha_look"] == pytest.approx(0.05 / (2 * len(SETTINGS.looks)))
    low = second.by_name["low-s0"]
    assert low.compute < 1.0 and low.starts == 1
    assert second.launcher.status(low.paths) == "exited"
    trials = {t.user_attrs["run"]: t for t in second.study.get_trials()}
    assert trials["low-s0"].state.name == "PRUNED" and trials["low-s0"].user_attrs["arm"] == "low"
    for name in ("good-s0", "twin-s0"):
        value = trials[name].value
        assert trials[name].state.name == "COMPLETE" and value is not None and abs(value - 0.68) < 0.06
    summary = json.loads((tmp_path / "sweep" / "sweep.json").read_text(encoding="utf-8"))
    low_arm = next(a for a in summary["arms"] if a["name"] == "low")
    assert low_arm["decision"] == "dominated" and low_arm["action"] == "stop" and "dominated by" in low_arm["why"]
    assert summary["pick"] in ("good", "twin") and summary["compute_share"] < 1.0
    scraped = scrape(second)
    assert scraped[("asymptote_sweep_arms", ("state", "stopped"))] == 1.0
    assert scraped[("asymptote_sweep_arms", ("state", "completed"))] == 2.0
    assert scraped[("asymptote_sweep_arms", ("state", "failed"))] == 0.0
    assert scraped[("asymptote_sweep_arm_stopped", ("arm", "low"))] == 1.0
    assert scraped[("asymptote_sweep_decisions_total", ("outcome", "dominated"))] >= 1.0
    assert scraped[("asymptote_sweep_decisions_total", ("outcome", "unstable"))] == 0.0
    assert scraped[("asymptote_sweep_compute_flops", ("kind", "saved"))] == pytest.approx(1.0 - low.compute)
    assert scraped[("asymptote_sweep_compute_flops", ("kind", "spent"))] == pytest.approx(summary["compute"])


def scrape(ctl: Controller) -> dict[tuple[str, tuple[str, str]], float]:
    """The controller's metrics as Prometheus scrapes them: over HTTP from prometheus_client's own server."""
    registry = CollectorRegistry()
    registry.register(SweepCollector(lambda: ctl.latest))
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        thread.join(10)
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if len(sample.labels) == 1:
                (label,) = sample.labels.items()
                out[(sample.name, label)] = sample.value
    return out


def test_an_audit_sweep_stops_nothing_and_its_report_checks_the_rule_against_the_whole_curves(
    tmp_path: Path,
) -> None:
    spec = sweep_spec(["good", "low"])
    ctl = controller(
        spec, tmp_path / "sweep", fake_launcher(tmp_path, curves([0.68, 0.48], ["good", "low"])), audit=True
    )
    drive(ctl, lambda: settled(ctl))
    assert states(ctl) == {"good-s0": "completed", "low-s0": "completed"}
    assert all(r.compute == 1.0 for r in ctl.runs)
    logged = decisions(tmp_path / "sweep")
    assert "audit: would stop" in {d["action"] for d in logged if d["arm"] == "low"}
    assert "stop" not in {d["action"] for d in logged}
    summary = json.loads((tmp_path / "sweep" / "sweep.json").read_text(encoding="utf-8"))
    low = next(a for a in summary["arms"] if a["name"] == "low")
    assert low["action"] == "audit: would stop" and low["final"]["outcome"] == "dominated" and low["borne_out"]
    assert summary["pick"] == "good" and summary["compute_share"] == 1.0
    good = next(a for a in summary["arms"] if a["name"] == "good")
    assert good["final"]["determined"] and good["final"]["a_interval"][0] < good["final"]["a"] < 0.68 + 0.06
    assert (tmp_path / "sweep" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match="started with --audit"):
        controller(spec, tmp_path / "sweep", fake_launcher(tmp_path, {}))


def test_seeds_pool_into_one_arm_and_a_restart_adopts_live_runs_and_the_shared_nats_server(tmp_path: Path) -> None:
    """Two arms x two seeds, two at a time, on one real nats-server. The controller is dropped mid-sweep; one
    live run is killed and its pid record pointed at a live process of another start time (a reused pid).
    The new controller adopts the live run (same pid, one start) and the live server (same pid), resumes the
    dead run (two starts), never exceeds two runs at once; every run's config names the one server, every
    run's eval.jsonl holds each round once, the arms' looks pool both seeds, and the server is stopped at
    the end."""
    spec = sweep_spec(["one", "two"], seeds=2, at_once=2)
    launcher = fake_launcher(tmp_path, curves([0.6, 0.61], ["one", "two"]))
    directory = tmp_path / "sweep"
    nats = SharedNats(directory)

    def at_most_two() -> None:
        live = [r for r in ctl.runs if ctl.launcher.status(r.paths) == "running"]
        assert len(live) <= 2

    ctl = controller(spec, directory, launcher, nats=nats)
    drive(ctl, lambda: all(r.rounds >= 3 for r in ctl.runs[:2]), at_most_two)
    server = nats.pid()
    assert server is not None
    kept, killed = ctl.runs[0].paths, ctl.runs[1].paths
    kept_pid = json.loads(kept.process.read_text(encoding="utf-8"))["pid"]
    record = json.loads(killed.process.read_text(encoding="utf-8"))
    os.kill(record["pid"], signal.SIGKILL)
    ctl.launcher.close()  # the old controller's child is reaped as if init had it
    launcher._children[killed.name].wait()
    assert process_start_ticks(record["pid"]) is None
    assert process_start_ticks(os.getpid()) != record["start_ticks"]
    killed.process.write_text(json.dumps({"pid": os.getpid(), "start_ticks": record["start_ticks"]}))
    nats = SharedNats(directory)
    ctl = controller(spec, directory, fake_launcher(tmp_path, {}), nats=nats)
    assert ctl.launcher.status(kept) == "running" and ctl.launcher.status(killed) == "exited"
    drive(ctl, lambda: settled(ctl), at_most_two)
    assert nats.pid() is None and process_start_ticks(server) is None
    assert json.loads(kept.process.read_text(encoding="utf-8"))["pid"] == kept_pid
    assert {r.name: r.starts for r in ctl.runs} == {"one-s0": 1, "two-s0": 2, "one-s1": 1, "two-s1": 1}
    urls = {yaml.safe_load(r.paths.config.read_text(encoding="utf-8"))["nats_url"] for r in ctl.runs}
    assert len(urls) == 1 and urls.pop().startswith("nats://127.0.0.1:")
    prefixes = {yaml.safe_load(r.paths.config.read_text(encoding="utf-8"))["prefix"] for r in ctl.runs}
    assert len(prefixes) == 4
    for run in ctl.runs:  # what `asymptote up --config` reads back is the run the plan made
        loaded = load_config(StackConfig, run.paths.config, "ASY_UP")
        assert loaded.task == run.arm.config.task and loaded.lr == run.arm.config.lr and loaded.seed == run.seed
        assert loaded.run_dir == run.paths.run_dir
    for run in ctl.runs:
        computes = [json.loads(line)["compute"] for line in (run.paths.run_dir / "eval.jsonl").open()]
        assert computes == sorted(set(computes)) and len(computes) == ROUNDS.size + 1
    assert max(d["seeds"] for d in decisions(directory)) == 2
    trials = ctl.study.get_trials()
    assert len(trials) == 4 and {t.user_attrs["arm"] for t in trials} == {"one", "two"}


def test_a_run_that_keeps_crashing_is_failed_with_its_reason_and_the_sweep_goes_on(tmp_path: Path) -> None:
    spec = sweep_spec(["good", "broken"])
    arms = curves([0.68, 0.66], ["good", "broken"])
    arms["broken"]["crash_after"] = 4
    ctl = controller(spec, tmp_path / "sweep", fake_launcher(tmp_path, arms))
    drive(ctl, lambda: settled(ctl))
    broken = ctl.by_name["broken-s0"]
    assert states(ctl) == {"good-s0": "completed", "broken-s0": "failed"}
    assert broken.starts == 3 and "crashed 3 times" in broken.reason and "out of memory after 4 rows" in broken.reason
    summary = json.loads((tmp_path / "sweep" / "sweep.json").read_text(encoding="utf-8"))
    assert next(a for a in summary["arms"] if a["name"] == "broken")["runs"][0]["reason"] == broken.reason


def test_an_arm_truncating_past_the_limit_is_unstable_and_its_stop_does_not_block(tmp_path: Path) -> None:
    """An arm whose training truncates 25% of its completions (metrics.jsonl) is stopped as unstable, never
    as dominated, though its curve is the leader's. Its run ignores SIGTERM: the controller does not wait on
    it (it steps on, and the other arm gains rounds, while the run lives) and kills it past the grace."""
    spec = sweep_spec(["good", "long"])
    arms = curves([0.68, 0.68], ["good", "long"])
    arms["good"]["steps"] = steps_of(ROUNDS.size + 1, 0.02)
    arms["long"]["steps"] = steps_of(ROUNDS.size + 1, 0.25)
    arms["long"]["ignore_sigterm"] = True
    ctl = controller(spec, tmp_path / "sweep", fake_launcher(tmp_path, arms, grace_s=2.0))
    long_run, good = ctl.by_name["long-s0"], ctl.by_name["good-s0"]
    drive(ctl, lambda: long_run.state == "stopped")
    assert long_run.closing and ctl.launcher.status(long_run.paths) == "running"
    rounds_at_stop = good.rounds
    drive(ctl, lambda: good.rounds > rounds_at_stop + 2)
    drive(ctl, lambda: settled(ctl))
    assert ctl.launcher.status(long_run.paths) == "exited" and good.state == "completed"
    stop = next(d for d in decisions(tmp_path / "sweep") if d["arm"] == "long" and d["action"] == "stop")
    assert stop["outcome"] == "unstable" and "truncation rate 25.0%" in stop["reason"]
    assert "dominated" not in {d["outcome"] for d in decisions(tmp_path / "sweep") if d["arm"] == "long"}


def test_rows_without_per_prompt_counts_are_reported_but_never_judged(tmp_path: Path) -> None:
    spec = sweep_spec(["good", "old"])
    arms = curves([0.68, 0.48], ["good", "old"])
    for row in arms["old"]["rows"]:
        del row["prompt_ids"], row["correct"], row["samples"]
    ctl = controller(spec, tmp_path / "sweep", fake_launcher(tmp_path, arms))
    drive(ctl, lambda: settled(ctl))
    assert states(ctl) == {"good-s0": "completed", "old-s0": "completed"}
    assert {d["arm"] for d in decisions(tmp_path / "sweep")} <= {"good"}
    old = ctl.by_name["old-s0"]
    assert old.rounds == 0 and "no per-prompt counts" in old.not_judged
    trial = next(t for t in ctl.study.get_trials() if t.user_attrs["run"] == "old-s0")
    assert len(trial.intermediate_values) == ROUNDS.size


def test_a_folder_holding_another_specs_sweep_is_refused_before_anything_starts(tmp_path: Path) -> None:
    launcher = fake_launcher(tmp_path, {})
    controller(sweep_spec(["one", "two"]), tmp_path / "sweep", launcher)
    other = sweep_spec(["one", "three"])
    plans: list[ArmPlan] = resolve(other)
    with pytest.raises(ConfigError, match="another spec"):
        Controller(other, plans, tmp_path / "sweep", launcher, settings=SETTINGS)
    assert not (tmp_path / "sweep" / "runs").exists()
    # A sweep started before a field was added (here extra_seeds, at its default then) is the same spec.
    held = json.loads((tmp_path / "sweep" / "spec.json").read_text(encoding="utf-8"))
    del held["spec"]["extra_seeds"]
    (tmp_path / "sweep" / "spec.json").write_text(json.dumps(held), encoding="utf-8")
    spec = sweep_spec(["one", "two"], extra_seeds=1)
    assert controller(spec, tmp_path / "sweep", launcher).spec == spec


def test_freed_compute_buys_the_undecided_leader_and_challenger_a_seed_each(tmp_path: Path) -> None:
    """Two recipes 0.015 apart (one seed each: undecided, the seed term alone is 0.021) and one far below,
    stopped early. The compute the low arm freed (a total of 5 runs' budgets) buys the leader and its
    closest challenger one more seed each, on curves of their own; the low arm gets none. A restart
    mid-way adopts the extra runs; their arms' looks then pool two seeds."""
    spec = sweep_spec(["good", "close", "low"], extra_seeds=1, budget={"per_arm": 1.0, "total": 5.0})
    arms = curves([0.68, 0.665, 0.48], ["good", "close", "low"])
    more = curves([0.68, 0.665], ["good-s1", "close-s1"], seed=3)
    launcher = fake_launcher(tmp_path, {**arms, **more})
    directory = tmp_path / "sweep"
    ctl = controller(spec, directory, launcher)
    drive(ctl, lambda: any(r.seed == 1 and r.rounds >= 2 for r in ctl.runs))
    added = {r.name: r.reason for r in ctl.runs if r.seed == 1}
    assert set(added) <= {"good-s1", "close-s1"} and all(why.startswith("extra seed: ") for why in added.values())
    started = {r.name for r in ctl.runs if r.seed == 1 and r.trial is not None}
    # A restart: the extra runs that started are adopted (one not started yet is decided again).
    ctl = controller(spec, directory, fake_launcher(tmp_path, {}))
    assert {r.name for r in ctl.runs if r.seed == 1} == started
    drive(ctl, lambda: settled(ctl))
    extra = {r.name: r for r in ctl.runs if r.seed == 1}
    assert set(extra) == {"good-s1", "close-s1"} and all(r.starts == 1 for r in extra.values())
    assert ctl.by_name["low-s0"].state == "stopped" and "low-s1" not in ctl.by_name
    trials = {t.user_attrs["run"]: t for t in ctl.study.get_trials()}
    assert (
        trials["good-s1"].user_attrs["extra"].startswith("extra seed: ") and trials["good-s1"].user_attrs["seed"] == 1
    )
    assert sum(r.compute for r in ctl.runs) <= 5.0
    assert any(d["seeds"] == 2 and d["arm"] in ("good", "close") for d in decisions(directory))
