"""The local run's progress: what it waits for before the first step, from the services' own readiness,
and the fit as the fitter's fit.json states it (A with its interval, or why it is not yet determined)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from services.fitter.collector import Collector
from services.fitter.compute_axis import ComputeAxis
from services.fitter.curve import CurveFitSettings
from services.local.progress import Progress, a_text, fit_text
from tests.helpers.fitcheck import known_eval_rows

READY = {"nats-server": True, "broker": True, "learner": True, "generator-0": True, "fitter": True}


def snap(step: int) -> dict[str, object]:
    return {"step": step, "policy_version": step, "batch_pass_rate": None, "samples_per_s": None,
            "staleness": None, "evals": [], "fit": {}}  # fmt: skip


def test_a_service_still_starting_is_named_with_its_reason() -> None:
    ready = {**READY, "generator-0": False, "learner": False}
    details = {"generator-0": "vLLM engine starting", "learner": ""}
    assert Progress.waiting(snap(0), ready, details) == "starting learner, generator-0 (vLLM engine starting)"


def test_all_ready_before_the_first_step_waits_for_rollouts() -> None:
    assert Progress.waiting(snap(0), READY, {}) == "waiting for the first batch of rollouts"


def test_once_steps_come_nothing_is_waited_for(tmp_path: Path) -> None:
    ready = {**READY, "generator-0": False}  # a restart mid-run shows in the services row, not as waiting
    assert Progress.waiting(snap(3), ready, {"generator-0": "vLLM engine starting"}) is None
    progress = Progress(tmp_path, max_steps=10)
    assert "starting" not in progress.line(snap(3), ready) and "step 3/10" in progress.line(snap(3), ready)


def test_the_line_and_the_panel_show_the_reason(tmp_path: Path) -> None:
    progress = Progress(tmp_path, max_steps=10)
    ready, details = {**READY, "generator-0": False}, {"generator-0": "vLLM engine starting"}
    assert progress.line(snap(0), ready, details).endswith("step 0/10  starting generator-0 (vLLM engine starting)")
    out = io.StringIO()
    Console(file=out, width=200).print(progress.render(snap(0), ready, details))
    assert "starting generator-0 (vLLM engine starting)" in out.getvalue()


def fitted(run_dir: Path, num_rows: int, planned_compute: float | None = None) -> dict[str, Any]:
    """fit.json as the live fitter writes it for ``num_rows`` eval rows on a known curve (A 0.7)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = known_eval_rows(num_rows, 0.7, 1.6, 3000.0, 0.25, compute_per_version=600.0)
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    settings = CurveFitSettings(num_bootstrap_resamples=20)
    Collector(run_dir, "known", settings, (2.0,), ComputeAxis(30.0), plot=False, planned_compute=planned_compute)
    fit: dict[str, Any] = json.loads((run_dir / "fit.json").read_text())
    return fit


def test_a_determined_fit_shows_a_with_its_interval_and_the_projection_at_the_budget(tmp_path: Path) -> None:
    fit = fitted(tmp_path, 13, planned_compute=30_000.0)
    assert fit["determined"] is True and fit["num_points_used"] == 12
    assert fit["a"] == pytest.approx(0.7, abs=1e-3)
    (at_budget,) = [p for p in fit["projections"] if p["compute"] == 30_000.0]
    a, c_mid, budget = fit["a_interval"], fit["c_mid_interval"], at_budget["interval"]
    a_shown = f"A {fit['a']:.3f} [{a['low']:.3f}, {a['high']:.3f}]"
    budget_shown = (
        f"at budget 8.33 device-hours: {at_budget['pass_rate']:.3f} [{budget['low']:.3f}, {budget['high']:.3f}]"
    )
    # Noiseless points: the bootstrap collapses onto the fit.
    assert a_shown == "A 0.700 [0.700, 0.700]"
    assert a_text(fit) == f"{a_shown}  {budget_shown}"
    line = Progress(tmp_path, max_steps=10).line({**snap(12), "fit": fit}, READY)
    assert line.endswith(f"step 12/10  {a_shown}  {budget_shown}")
    assert fit_text(fit) == (
        f"{a_shown}  B {fit['b']:.2f}  C_mid {fit['c_mid'] / 3600:,.2f} [{c_mid['low'] / 3600:,.2f}, "
        f"{c_mid['high'] / 3600:,.2f}] device-hours  "
        f"R0 0.250  {budget_shown}  {fit['recommendation']}: {fit['recommendation_reason']}"
    )


def test_an_undetermined_fit_shows_only_as_interval_and_what_would_determine_it() -> None:
    """The reported run: A 0.562 [0.402, 1.000], C_mid [201, 173442], identifiable; the fitter now writes this."""
    why = (
        "A's interval [0.402, 1.000] reaches the cap 1.000: run longer, until the curve bends; "
        "C_mid's interval [201, 1.734e+05] spans 863x (at most 10x): more points past the midpoint"
    )
    fit = {
        "ok": True,
        "a": 0.562,
        "b": 0.61,
        "c_mid": 5901.0,
        "r0": 0.301,
        "a_interval": {"low": 0.402, "high": 1.0},
        "c_mid_interval": {"low": 201.0, "high": 173_442.0},
        "identifiable": True,
        "determined": False,
        "why_not_determined": why,
        "not_determined": ["a_at_cap", "c_mid_spread"],
        "planned_compute": 36_000.0,
        "projections": [{"compute": 36_000.0, "pass_rate": 0.51, "interval": {"low": 0.44, "high": 0.93}}],
        "recommendation": "continue",
        "recommendation_reason": f"not yet determined: {why}",
    }
    assert a_text(fit) == f"A in [0.402, 1.000], not yet determined: {why}"
    assert fit_text(fit) == f"A in [0.402, 1.000], not yet determined: {why}  R0 0.301"
    line = Progress(Path("."), max_steps=300).line({**snap(240), "fit": fit}, READY)
    # Neither the point estimate, nor the projection, nor a gain read off the cap.
    assert "0.562" not in line and "0.510" not in line and "budget" not in line and "left to gain" not in line
    # The live line keeps to a terminal's width: the first reason in a few words, and how many more.
    assert line.endswith("A in [0.402, 1.000], not yet determined: A's interval reaches the cap (+1)")
    assert len(line) <= 100


def test_too_few_points_show_no_interval_and_no_fit_shows_its_reason(tmp_path: Path) -> None:
    fit = fitted(tmp_path / "few", 6)  # R0 and 5 points: a fit, but too few points to determine it
    assert fit["ok"] and fit["not_determined"] == ["few_points"]
    assert a_text(fit) == "A not yet determined: 5 points used, at least 8: more eval rounds"
    none = fitted(tmp_path / "none", 4)  # R0 and 3 points: no fit
    assert a_text(none) is None and fit_text(none) == none["reason"] == none["why_not_determined"]
    assert none["determined"] is False and none["reason"].startswith("too few points")


def test_the_summary_keeps_whether_the_fit_is_determined(tmp_path: Path) -> None:
    fit = fitted(tmp_path, 13)
    progress = Progress(tmp_path, max_steps=12)
    progress.console = Console(file=io.StringIO(), width=300)
    progress.finish({})
    summary = json.loads((tmp_path / "summary.json").read_text())["fit"]
    assert summary["determined"] is True and summary["why_not_determined"] == "" and summary["not_determined"] == []
    assert summary["a_interval"] == fit["a_interval"] and summary["c_mid_interval"] == fit["c_mid_interval"]


def test_the_line_shows_tokens_per_second_an_eta_and_warns_of_truncation(tmp_path: Path) -> None:
    rows = [
        {"step": s, "policy_version": s, "unix_s": 100.0 + 4.0 * s, "batch/samples": 128.0, "batch/tokens": 8000.0,
         "reward/pass_rate": 0.5, "rollout/completions": 128.0, "rollout/truncated": 64.0 if s > 20 else 1.0}
        for s in range(1, 31)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    progress = Progress(tmp_path, max_steps=120)
    now = progress.snapshot()
    # Nine steps of 8,000 tokens in 36 s; 90 steps left at 4 s each.
    assert now["tokens_per_s"] == pytest.approx(2000.0) and now["eta_s"] == pytest.approx(360.0)
    line = progress.line(now)
    assert "2,000 tokens/s" in line and "ETA 6m" in line
    # The last 20 steps: 10 at 1 of 128 and 10 at 64 of 128, 25.4%; the first 20 at 0.8%.
    assert "warning: unstable: truncation rose from 1% to 25% over the last 20 steps" in line
    for row in rows:
        row["rollout/truncated"] = 1.0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "warning" not in progress.line(progress.snapshot())


def test_the_summary_shows_training_compute_and_eval_sampling_apart(tmp_path: Path) -> None:
    from asymptote.compute import device_time
    from services.local.progress import compute_text

    (tmp_path / "fit.json").write_text(json.dumps({"compute_by_service": {"generator": 3000.0, "learner": 600.0,
                                                                          "eval": 1000.0}}))  # fmt: skip
    progress = Progress(tmp_path, max_steps=12)
    out = io.StringIO()
    progress.console = Console(file=out, width=300)
    progress.finish({})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["compute_by_service"] == {"generator": 3000.0, "learner": 600.0, "eval": 1000.0}
    # By hand: training 3,600 s = 1.00 device-hours; eval 1,000 of the 4,000 generation seconds.
    said = (
        "training 1.00 device-hours (generator 0.83 device-hours, learner 0.17 device-hours); "
        "eval sampling 0.28 device-hours, 25% of generation, off the curve's axis"
    )
    assert compute_text(summary["compute_by_service"]) == said and said in " ".join(out.getvalue().split())
    assert compute_text({"generator": 100.0, "learner": 20.0}) == (
        "training 120 device-s (generator 100 device-s, learner 20 device-s); eval sampling 0 device-s, "
        "0% of generation, off the curve's axis"
    )
    assert compute_text({}) is None
    # One unit for a line, chosen by its total: 736 s is 0.20 device-hours, and so are its parts.
    assert compute_text({"generator": 340.0, "learner": 396.0, "eval": 10.0}) == (
        "training 0.20 device-hours (generator 0.09 device-hours, learner 0.11 device-hours); eval sampling "
        "0.00 device-hours, 3% of generation, off the curve's axis"
    )
    assert compute_text({"generator": 340.0}, {"generator": 2.0e14, "learner": 1.2e15, "eval": 5.0e12}) == (
        "training 1.4 PFLOP (generator 0.2 PFLOP, learner 1.2 PFLOP); eval sampling 0.005 PFLOP, 2% of generation, "
        "off the curve's axis; held 340 device-s (generator 340 device-s) and 0 device-s sampling evals: the run's cost"
    )
    # An interval in its point's unit: C_mid's, in seconds for a short run.
    assert device_time(201.0, 150.0, 173_442.0) == "201 [150, 173,442] device-s"
    assert device_time(5901.0, 201.0, 173_442.0) == "1.64 [0.06, 48.18] device-hours"


def test_the_summary_shows_the_flops_axis_and_the_device_time_held_as_the_cost(tmp_path: Path) -> None:
    from services.local.progress import compute_text

    seconds = {"generator": 3000.0, "learner": 600.0, "eval": 1000.0}
    flops = {"generator": 2.0e14, "learner": 6.0e14, "eval": 5.0e13}
    (tmp_path / "fit.json").write_text(json.dumps({"compute_by_service": seconds, "flops_by_service": flops}))
    progress = Progress(tmp_path, max_steps=12)
    out = io.StringIO()
    progress.console = Console(file=out, width=400)
    progress.finish({})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["compute_by_service"] == seconds and summary["flops_by_service"] == flops
    # By hand: 800 TFLOP trained, eval 50 of the 250 TFLOP generated; 3,600 s held = 1.00 device-hours.
    said = (
        "training 800 TFLOP (generator 200 TFLOP, learner 600 TFLOP); eval sampling 50 TFLOP, 20% of generation, "
        "off the curve's axis; held 1.00 device-hours (generator 0.83 device-hours, learner 0.17 device-hours) and "
        "0.28 device-hours sampling evals: the run's cost"
    )
    assert compute_text(seconds, flops) == said and said in " ".join(out.getvalue().split())
