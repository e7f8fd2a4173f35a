"""``asymptote bench --quick`` runs every benchmark it covers and writes a well-formed report.

Checks the report's structure and internal consistency, never the timing
targets (those are measured by the full command, not by tests).
"""

from __future__ import annotations

import json
import math
import operator
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.transfercheck import check_transfer_figures

REPO = Path(__file__).resolve().parents[1]
FIGURES = {
    "learner_step_service_vs_bare",
    "learner_step_serving_every_step_vs_alone",
    "learner_memory_fsdp2_2_ranks_vs_1",
    "learner_memory_fsdp2_2_ranks_vs_1_activation_checkpointing",
    "learner_peak_rss_fsdp2_2_ranks_vs_1",
    "learner_step_fsdp2_vs_ddp_2_cpu_ranks",
    "fitter_fit_and_bootstrap_1000_points",
    "weight_transfer_grpc_vs_disk",
    "weight_transfer_relay_hop_vs_disk",
    "weights_digest_blake3_vs_sha256",
    "broker_groups_per_s_vs_raw_nats",
    "pipeline_samples_per_s_inflight_vs_sync",
    "generator_tokens_per_s_in_loop_vs_standalone",
    "swap_pause_median_vs_memory_copy",
    "learning_speed_onpolicy_vs_stack",
    "sweep_wrong_eliminations",
    "sweep_chosen_within_margin",
    "sweep_compute_share",
}
FULL_ONLY = {
    "generator_tokens_per_s_in_loop_vs_standalone",
    "sweep_wrong_eliminations",
    "sweep_chosen_within_margin",
    "sweep_compute_share",
    "pipeline_samples_per_s_inflight_vs_sync",
    "learning_speed_onpolicy_vs_stack",
    "learner_memory_fsdp2_2_ranks_vs_1_activation_checkpointing",
}


def test_a_measured_stack_run_waits_for_metric_samples_not_for_time(tmp_path: Path) -> None:
    """However fast the steps come, a measured run may stop only once its steady part holds
    RATE_SAMPLES samples of the services' counters, so the in-loop rate always has them."""
    from benchmarks.run import RATE_SAMPLES, Scraper, rates_measurable, steady_window
    from services.local.config import StackConfig
    from services.local.stack import LocalStack

    metrics = tmp_path / "metrics.jsonl"
    # Eight steps in 1.4 s: a machine faster than the one-second sampling.
    metrics.write_text("".join(json.dumps({"step": i, "unix_s": 100.0 + 0.2 * i}) + "\n" for i in range(8)))
    scraper = Scraper(LocalStack(StackConfig(run_dir=tmp_path)))
    t_from, t_to = steady_window([json.loads(line) for line in metrics.read_text().splitlines()])
    assert (t_from, t_to) == (100.2, 101.4)
    counter = Scraper.COUNTERS[0]
    scraper.samples = [(100.5, {counter: 10.0}), (101.3, {counter: 30.0})]
    assert scraper.rate(counter, t_from, t_to) == pytest.approx(25.0)
    assert not rates_measurable(scraper, metrics, min_steps=8)
    scraper.samples = [(100.2 + 0.2 * i, {counter: 10.0 * i}) for i in range(RATE_SAMPLES)]
    assert rates_measurable(scraper, metrics, min_steps=8)
    assert not rates_measurable(scraper, metrics, min_steps=9)


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
    compare = {"at least": operator.ge, "at most": operator.le, "under": operator.lt}
    for name, f in figures.items():
        assert {"value", "unit", "ratio", "baseline", "measured", "targets", "target", "met"} <= f.keys(), name
        assert f["targets"], name
        if name in FULL_ONLY:
            assert f["met"] is None and f["value"] is None and f["ratio"] is None, name
            continue
        assert isinstance(f["met"], bool), name
        assert math.isfinite(f["value"]) and f["value"] > 0, name
        assert f["ratio"] is None or (math.isfinite(f["ratio"]) and f["ratio"] > 0), name
        # Each verdict follows from its numbers and targets.
        assert f["met"] == all(compare[t["direction"]](f[t["of"]], t["bound"]) for t in f["targets"]), name
    assert figures["learner_step_service_vs_bare"]["met"] == (figures["learner_step_service_vs_bare"]["ratio"] <= 1.15)
    fitter = figures["fitter_fit_and_bootstrap_1000_points"]
    assert fitter["unit"] == "s" and fitter["met"] == (fitter["value"] < 2.0)
    # The markdown table has one row per figure, with its verdict.
    table = (out / "bench.md").read_text()
    for name, f in figures.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert row.rstrip().endswith({True: "| met |", False: "| MISSED |", None: "| not run |"}[f["met"]])
    # The weight transfer section's figures add up, and what it pulled is what it served.
    check_transfer_figures(
        figures["weight_transfer_grpc_vs_disk"], figures["weight_transfer_relay_hop_vs_disk"], out / "transfer"
    )
    # The stack run it measured from ran its steps and kept its ledger balanced.
    assert len((out / "pipeline-inflight" / "metrics.jsonl").read_text().splitlines()) >= 8
    ledger = json.loads((out / "pipeline-inflight" / "ledger.json").read_text())
    assert ledger["lost"] == 0 and ledger["trained_twice"] == 0
