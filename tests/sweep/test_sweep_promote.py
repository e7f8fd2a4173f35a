"""``asymptote sweep promote``: the pick's forecast recorded first, then its run continued and judged against
it. The run is ``fake_run.py`` (a real child process standing in for ``asymptote up --resume``), whose curve
goes on past the sweep's budget along the same known sigmoid."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from asymptote.errors import ConfigError
from benchmarks.sweep import simulate_arms
from services.sweep.launcher import LocalLauncher, RunPaths
from services.sweep.promote import promote
from services.sweep.spec import SweepSpec

FAKE_RUN = Path(__file__).with_name("fake_run.py")
ROUNDS = np.arange(1, 81) / 40.0  # to twice the sweep's budget


def sweep_folder(tmp_path: Path, pick: str | None) -> tuple[Path, Path]:
    spec = SweepSpec.model_validate(
        {"arms": {"variants": [{"name": "good", "set": {"lr": 2e-4}}, {"name": "low", "set": {"lr": 3e-4}}]},
         "include_base": False, "budget": {"per_arm": 1.0}, "warmup": 0.1}
    )  # fmt: skip
    directory = tmp_path / "sweep"
    (directory / "runs" / "good-s0" / "run").mkdir(parents=True)
    (directory / "spec.json").write_text(json.dumps({"spec": spec.model_dump(mode="json"), "audit": False}))
    (directory / "sweep.json").write_text(json.dumps({"pick": pick}))
    (arm,) = simulate_arms([0.66], [2.0], [0.3], np.random.default_rng(11), ROUNDS)
    ids = [f"p{i:04d}" for i in range(arm.baseline.correct.size)]
    rows = [
        {"policy_version": i, "compute": r.compute, "compute_unit": "flops", "pass_rate": r.pass_rate,
         "prompt_ids": ids, "correct": r.correct.tolist(), "samples": [r.num_samples] * len(ids)}
        for i, r in enumerate((arm.baseline, *arm.rounds))
    ]  # fmt: skip
    run_dir = directory / "runs" / "good-s0" / "run"
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:41]))  # to the budget
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"rows": rows}))
    (run_dir.parent / "release").write_text(str(len(rows)))
    return directory, curve


def test_the_pick_is_forecast_first_then_continued_and_judged_against_the_forecast(tmp_path: Path) -> None:
    directory, curve = sweep_folder(tmp_path, "good")

    def command(run: RunPaths, resume: bool) -> list[str]:
        assert (directory / "promote" / "good.json").exists(), "the run went on before its forecast was recorded"
        return [sys.executable, str(FAKE_RUN), str(curve), "--resume", str(run.run_dir)]

    rows: list[dict[str, object]] = []
    done = promote(directory, 2.0, launcher=LocalLauncher(command), poll_s=0.05, report=rows.append)
    record = json.loads((directory / "promote" / "good.json").read_text())
    assert record["from_compute"] == 1.0 and record["budget"] == 2.0 and record["determined"]
    assert record["band"][0] < record["projected"] < record["band"][1]
    logged = [json.loads(line) for line in (directory / "promote" / "good.jsonl").read_text().splitlines()]
    assert logged == rows and [r["compute"] for r in logged] == list(ROUNDS[40:])
    for r in logged:
        assert r["error"] == pytest.approx(r["observed"] - r["forecast"])
        low, high = r["expected"]
        assert low < r["band"][0] < r["band"][1] < high and r["inside"] == (low <= r["observed"] <= high)
    # The curve's band and the eval noise together hold most observations of the true curve.
    assert sum(bool(r["inside"]) for r in logged) >= 0.8 * len(logged)
    # A known sigmoid measured on 1,000 prompts x 16 samples: forecast from its first half, to 2x the compute.
    assert abs(done["last"]["error"]) < 0.03 and done["last"]["compute"] == 2.0
    again = promote(directory, 2.0, launcher=LocalLauncher(command), poll_s=0.05)
    assert json.loads((directory / "promote" / "good.json").read_text()) == record  # the same forecast, not a refit
    assert len((directory / "promote" / "good.jsonl").read_text().splitlines()) == len(logged)
    assert again["forecast"]["projected"] == record["projected"]
    with pytest.raises(ConfigError, match="was promoted to 2, not 3"):
        promote(directory, 3.0, launcher=LocalLauncher(command))


def test_a_sweep_without_a_pick_or_a_budget_not_above_its_own_is_refused(tmp_path: Path) -> None:
    directory, _ = sweep_folder(tmp_path, None)
    with pytest.raises(ConfigError, match="picked no arm"):
        promote(directory, 2.0)
    with pytest.raises(ConfigError, match="not above the sweep's budget"):
        promote(directory, 1.0, arm="good")
    assert not (directory / "promote").exists()
