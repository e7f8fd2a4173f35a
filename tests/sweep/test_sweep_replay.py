"""``asymptote sweep replay`` over finished runs written as run directories (eval.jsonl with each held-out
prompt's counts, metrics.jsonl), from arms whose true curves are known (``benchmarks.sweep``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.sweep import simulate_arms
from services.cli import main
from services.fitter.curve import CurveFitSettings
from services.sweep.replay import find_runs, read_run, replay
from services.sweep.rule import Arm, SweepSettings

ROUNDS = np.arange(1, 41) / 40.0
SETTINGS = SweepSettings(
    warmup_compute=0.1, budget_compute=1.0, num_resamples=50, curve=CurveFitSettings(num_bootstrap_resamples=50)
)


def write_run(run_dir: Path, arm: Arm, truncation: float = 0.02) -> Path:
    run_dir.mkdir(parents=True)
    ids = [f"p{i:04d}" for i in range(arm.baseline.correct.size)]
    rounds = (arm.baseline, *arm.rounds)
    with (run_dir / "eval.jsonl").open("w") as out:
        for i, r in enumerate(rounds):
            row: dict[str, Any] = {"policy_version": i, "compute": r.compute, "compute_unit": "flops",
                                   "pass_rate": r.pass_rate, "prompt_ids": ids, "correct": r.correct.tolist(),
                                   "samples": [r.num_samples] * len(ids)}  # fmt: skip
            out.write(json.dumps(row) + "\n")
    with (run_dir / "metrics.jsonl").open("w") as out:
        for i in range(1, len(rounds)):
            out.write(json.dumps({"policy_version": i, "rollout/completions": 100.0,
                                  "rollout/truncated": 100.0 * truncation, "loss": 0.01}) + "\n")  # fmt: skip
    return run_dir


def test_a_replay_stops_the_dominated_arm_at_a_look_and_eliminates_nothing_falsely(tmp_path: Path) -> None:
    """A sweep folder of two recipes x two seeds (A 0.68 and 0.48, past their bend by the 40% look) and an
    unstable third arm: the low arm is stopped as dominated before the budget, the truncating one as
    unstable, the leader runs on; the saved compute is what the stopped runs' cuts leave of their budgets."""
    arms = simulate_arms([0.68, 0.675, 0.48, 0.485, 0.66], [2.0] * 5, [0.15] * 5, np.random.default_rng(7), ROUNDS)
    names = ["good-s0", "good-s1", "low-s0", "low-s1", "long-s0"]
    for name, arm in zip(names, arms, strict=True):
        write_run(tmp_path / "sweep" / "runs" / name / "run", arm, truncation=0.3 if name == "long-s0" else 0.02)
    found = find_runs([tmp_path / "sweep"])
    assert sorted(arm for arm, _ in found) == ["good", "good", "long", "low", "low"]
    runs = [read_run(path, arm)[0] for arm, path in found]
    report = replay(runs, SETTINGS)
    low, good, long_ = report["arms"]["low"], report["arms"]["good"], report["arms"]["long"]
    assert good["stopped"] is None and good["seeds"] == 2 and good["whole_curve"]["determined"]
    assert low["stopped"]["outcome"] == "dominated" and low["stopped"]["look_compute"] < 1.0
    assert long_["stopped"]["outcome"] == "unstable" and "truncation" in long_["stopped"]["reason"]
    assert report["false_eliminations"] == [] and not any(a["false_elimination"] for a in report["arms"].values())
    cut = {name: min(r for r in ROUNDS if r >= s["look_compute"] - 1e-9) for name, s in
           ((n, report["arms"][n]["stopped"]) for n in ("low", "long"))}  # fmt: skip
    assert report["compute_saved"] == pytest.approx(2 * (1.0 - cut["low"]) + (1.0 - cut["long"]))
    assert report["compute_planned"] == 5.0 and report["compute_share"] < 1.0
    cov = report["coverage"]
    assert (
        cov["intervals"] > 0 and 0.0 <= cov["share"] <= 1.0 and cov["covered"] == round(cov["share"] * cov["intervals"])
    )


def test_identical_recipes_are_not_eliminated_in_a_replay(tmp_path: Path) -> None:
    arms = simulate_arms([0.6, 0.6], [2.0, 2.0], [0.15, 0.15], np.random.default_rng(8), ROUNDS)
    paths = [write_run(tmp_path / name, arm) for name, arm in zip(["a", "b"], arms, strict=True)]
    runs = [read_run(path, arm)[0] for arm, path in find_runs(paths)]
    report = replay(runs, SETTINGS)
    assert all(a["stopped"] is None for a in report["arms"].values()) and report["compute_share"] == 1.0


def test_the_replay_command_writes_its_report_and_refuses_runs_without_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arms = simulate_arms([0.68, 0.48], [2.0, 2.0], [0.15, 0.15], np.random.default_rng(9), ROUNDS)
    paths = [str(write_run(tmp_path / n, arm)) for n, arm in zip(["x", "y"], arms, strict=True)]
    out = tmp_path / "report"
    assert main(["sweep", "replay", *paths, "--arm", "good", "--arm", "low", "--warmup", "0.1", "--out", str(out)]) == 0
    report = json.loads((out / "replay.json").read_text())
    assert set(report["arms"]) == {"good", "low"} and report["settings"]["budget_compute"] == 1.0
    assert "false eliminations 0" in capsys.readouterr().out
    eval_path = Path(paths[1]) / "eval.jsonl"
    rows = [json.loads(line) for line in eval_path.read_text().splitlines()]
    eval_path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "correct"}) + "\n" for r in rows))
    assert main(["sweep", "replay", *paths, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no per-prompt counts" in err and paths[1] in err
