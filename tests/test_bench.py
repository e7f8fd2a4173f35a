"""``asymptote bench --quick`` runs every benchmark it covers and writes a well-formed report.

Checks the report's structure and internal consistency, never the timing
targets (those are measured by the full command, not by tests).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIGURES = {
    "learner_step_service_vs_bare",
    "fitter_fit_and_bootstrap_1000_points",
    "weight_transfer_grpc_vs_disk",
    "broker_groups_per_s_vs_raw_nats",
    "pipeline_samples_per_s_inflight_vs_sync",
    "generator_tokens_per_s_in_loop_vs_standalone",
    "swap_pause_median_vs_memory_copy",
    "learning_speed_plus_0.3_onpolicy_vs_stack",
}
FULL_ONLY = {"pipeline_samples_per_s_inflight_vs_sync", "learning_speed_plus_0.3_onpolicy_vs_stack"}


@pytest.mark.e2e
@pytest.mark.vllm
def test_quick_bench_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "--output", str(out), "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "bench.json").read_text())
    assert report["mode"] == "quick" and report["errors"] == []
    assert report["machine"]["cores"] >= 1 and report["machine"]["packages"]["vllm"]
    figures = {f["name"]: f for f in report["figures"]}
    assert set(figures) == FIGURES and len(report["figures"]) == len(FIGURES)
    for name, f in figures.items():
        assert {"baseline", "measured", "target", "passed"} <= f.keys(), name
        if name in FULL_ONLY:
            assert f["passed"] is None and "ratio" not in f and "seconds" not in f, name
            continue
        assert isinstance(f["passed"], bool), name
        values = [f[k] for k in ("ratio", "seconds") if k in f]
        assert len(values) == 1 and math.isfinite(values[0]) and values[0] > 0, name
    # Each verdict follows from its value and target.
    assert figures["learner_step_service_vs_bare"]["passed"] == (
        figures["learner_step_service_vs_bare"]["ratio"] <= 1.15
    )
    assert figures["fitter_fit_and_bootstrap_1000_points"]["passed"] == (
        figures["fitter_fit_and_bootstrap_1000_points"]["seconds"] < 2.0
    )
    gen = figures["generator_tokens_per_s_in_loop_vs_standalone"]
    assert gen["passed"] == (gen["ratio"] >= 0.9)
    # The markdown table has one row per figure, with its verdict.
    table = (out / "bench.md").read_text()
    for name, f in figures.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert row.rstrip().endswith({True: "| met |", False: "| MISSED |", None: "| not run |"}[f["passed"]])
    # The stack run it measured from trained and kept its ledger balanced.
    ledger = json.loads((out / "pipeline-inflight" / "ledger.json").read_text())
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0
