"""The half-run check: fit the first half of a run's compute, project its end,
compare with what was measured there; bad rows give a reason, never an
exception; the local stack's summary.json carries the result."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.fitter.collector import Collector
from services.fitter.compute_axis import ComputeAxis
from services.fitter.curve import CurveFitSettings, predict
from services.fitter.holdout import half_run_projection, project_from_half
from services.local.config import StackConfig
from services.local.progress import fit_text
from services.local.stack import LocalStack
from tests.helpers.fitcheck import known_eval_rows

A, B, C_MID, R0 = 0.610, 1.92, 2542.0, 0.20
SETTINGS = CurveFitSettings(num_bootstrap_resamples=100)


def _rows(num_evals: int = 25, r0_compute: float = 0.0, noise_sd: float = 0.003) -> list[dict[str, Any]]:
    """Eval rows as the live fitter writes them: step 0 is R0, then evals up to 2 x C_mid."""
    compute = np.linspace(0.0, 2.0 * C_MID, num_evals)
    rng = np.random.default_rng(0)
    rows = [{"step": 0, "policy_version": 0, "compute": r0_compute, "pass_rate": R0, "num_prompts": 200}]
    for i, c in enumerate(compute[1:], start=1):
        rate = float(predict(c, A, B, C_MID, R0)) + rng.normal(0.0, noise_sd)
        rows.append({"step": 10 * i, "policy_version": 10 * i, "compute": float(c), "pass_rate": rate})
    return rows


def test_first_half_projects_the_end_of_the_run() -> None:
    rows = _rows()
    out = half_run_projection(rows, SETTINGS)
    assert out["reason"] == ""
    assert out["final_compute"] == pytest.approx(2.0 * C_MID)
    assert out["half_compute"] == pytest.approx(C_MID)
    # Curve points k * C_mid / 12 (k = 1..24); the first half is k = 1..12, all
    # used (the default early cutoff is at compute 0).
    assert out["points_in_first_half"] == 12
    assert out["points_used"] == 12
    assert out["measured"] == rows[-1]["pass_rate"]
    truth_at_end = float(predict(2.0 * C_MID, A, B, C_MID, R0))
    assert abs(out["projected"] - truth_at_end) < 0.02
    assert out["error"] == pytest.approx(out["projected"] - out["measured"])
    assert out["level"] == 0.95
    low, high = out["interval"]
    assert low <= out["projected"] <= high
    assert low <= truth_at_end <= high
    # Rows in any order give the same answer: they are taken in step order.
    assert half_run_projection(rows[::-1], SETTINGS) == out


def test_r0_row_is_not_a_curve_point_whatever_its_compute() -> None:
    """The live fitter stamps version 0 with the compute at its publication, which can be > 0."""
    at_zero = half_run_projection(_rows(r0_compute=0.0), SETTINGS)
    at_five = half_run_projection(_rows(r0_compute=5.0), SETTINGS)
    assert at_five == at_zero


def test_project_from_half_on_arrays_matches_the_rows_version() -> None:
    rows = _rows()
    direct = project_from_half([r["compute"] for r in rows[1:]], [r["pass_rate"] for r in rows[1:]], R0, SETTINGS)
    assert direct == half_run_projection(rows, SETTINGS)


def _corrupt(case: str) -> tuple[list[Any], str]:
    rows = _rows()
    if case == "nan":
        rows[3]["pass_rate"] = math.nan
        return rows, "eval.jsonl row[3]: pass_rate: Input should be a finite number"
    if case == "negative_compute":
        rows[4]["compute"] = -1.0
        return rows, "eval.jsonl row[4]: compute: Input should be greater than or equal to 0"
    if case == "missing_key":
        del rows[5]["compute"]
        return rows, "eval.jsonl row[5]: compute: Field required"
    if case == "r0_outside":
        rows[0]["pass_rate"] = 1.2
        return rows, "eval.jsonl row[0]: pass_rate: Input should be less than or equal to 1"
    if case == "decreasing_compute":
        rows[7]["compute"] = rows[6]["compute"] - 1.0
        return rows, (
            f"eval.jsonl row[7]: compute {rows[7]['compute']:g} at step 70 is below compute "
            f"{rows[6]['compute']:g} at step 60 (eval.jsonl row[6])"
        )
    if case == "not_an_object":
        return [*rows, [1, 2]], "eval.jsonl row[25]: expected a JSON object, got list"
    if case == "constant":
        for row in rows[1:]:
            row["pass_rate"] = 0.4
        return rows, f"first half (compute <= {C_MID:g}): all pass rates equal (0.4) after the cutoff"
    if case == "too_few":
        return _rows(num_evals=5), f"first half (compute <= {C_MID:g}): too few points after the early cutoff"
    if case == "only_r0":
        return _rows()[:1], "needs at least two evaluations (R0's and one more), got 1"
    if case == "one_point_after_r0":
        return _rows()[:2], "needs at least two curve points after R0, got 1"
    if case == "empty":
        return [], "eval.jsonl row: no evaluation records"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "nan",
        "negative_compute",
        "missing_key",
        "r0_outside",
        "decreasing_compute",
        "not_an_object",
        "constant",
        "too_few",
        "only_r0",
        "one_point_after_r0",
        "empty",
    ],
)
def test_bad_or_degenerate_rows_give_a_reason_not_an_exception(case: str) -> None:
    rows, reason = _corrupt(case)
    out = half_run_projection(rows, SETTINGS)
    assert out["reason"].startswith(reason), out["reason"]
    assert out["projected"] is None and out["error"] is None and out["interval"] is None


def test_local_stack_summary_reports_the_half_run_projection(tmp_path: Path) -> None:
    """What ``asymptote up`` writes at the end of a run (a stack built, never started, closes)."""
    rows = _rows()
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with LocalStack(StackConfig(run_dir=tmp_path, max_steps=240)):
        pass
    summary = json.loads((tmp_path / "summary.json").read_text())
    entry = summary["half_run_projection"]
    expected = half_run_projection(rows)
    assert entry == expected  # JSON round-trips floats exactly; the bootstrap is seeded
    assert entry["reason"] == "" and entry["measured"] == summary["heldout_pass_rate_final"]
    assert abs(entry["error"]) < 0.03


def test_local_stack_summary_says_not_yet_identifiable_for_a_fit_at_its_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fitter's fit.json of a run at A's bound: the summary flags it and shows no projection."""
    rows = known_eval_rows(25, A, B, C_MID, R0, compute_per_version=2.0 * C_MID / 24)
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    paper_range = CurveFitSettings(a_min=0.45, a_max=0.55, num_bootstrap_resamples=20)
    collector = Collector(tmp_path, tmp_path.name, paper_range, (2.0,), ComputeAxis(30.0), plot=False)
    assert collector.projection.ok and list(collector.projection.at_bound) == ["A"]
    monkeypatch.setenv("COLUMNS", "400")  # the summary table's rows on one line each
    with LocalStack(StackConfig(run_dir=tmp_path, max_steps=240)):
        pass
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["fit"]["ok"] is True
    assert summary["fit"]["identifiable"] is False and summary["fit"]["at_bound"] == ["A"]
    assert summary["fit"]["recommendation"] == "continue"
    assert summary["fit"]["determined"] is False and summary["fit"]["not_determined"] == ["at_bound"]
    printed = " ".join(capsys.readouterr().out.split())
    a_interval = summary["fit"]["a_interval"]
    assert (
        f"A in [{a_interval['low']:.3f}, {a_interval['high']:.3f}], not yet determined: "
        "A at the bound of the search range: run longer"
    ) in printed
    assert "A 0.550" not in printed  # no point estimate, no projection from a bound-limited fit


def test_fit_text_shows_the_curve_and_recommendation_of_a_determined_fit() -> None:
    fit = {
        "ok": True,
        "a": 0.61,
        "b": 1.92,
        "c_mid": 2542.0,
        "r0": 0.2,
        "a_interval": {"low": 0.6, "high": 0.62},
        "c_mid_interval": {"low": 2300.0, "high": 2900.0},
        "at_bound": [],
        "identifiable": True,
        "determined": True,
        "why_not_determined": "",
        "not_determined": [],
        "planned_compute": 0.0,
        "recommendation": "stop",
        "recommendation_reason": "the gain left to the asymptote is at most 0.010, within the margin 0.02",
    }
    assert fit_text(fit) == (
        "A 0.610 [0.600, 0.620]  B 1.92  C_mid 0.71 [0.64, 0.81] device-hours  R0 0.200  "
        "stop: the gain left to the asymptote is at most 0.010, within the margin 0.02"
    )
    budget = {"compute": 20_000.0, "pass_rate": 0.605, "interval": {"low": 0.598, "high": 0.612}}
    with_budget = {**fit, "planned_compute": 20_000.0, "projections": [budget]}
    assert fit_text(with_budget) == (
        "A 0.610 [0.600, 0.620]  B 1.92  C_mid 0.71 [0.64, 0.81] device-hours  R0 0.200  "
        "at budget 5.56 device-hours: 0.605 [0.598, 0.612]  "
        "stop: the gain left to the asymptote is at most 0.010, within the margin 0.02"
    )
    assert fit_text({"ok": False, "reason": "too few points"}) == "too few points"
    assert fit_text({}) is None


def test_the_check_ends_in_a_verdict_by_the_rule_every_fit_is_held_to() -> None:
    """Landed (within the margin of the measured end), missed (beyond it), or, with fewer than 8 points in the
    first half's fit, too few points to say: then no projected value is stated, only its interval."""
    landed = half_run_projection(_rows(), SETTINGS)
    assert (landed["verdict"], landed["determined"]) == ("landed", True)
    assert landed["verdict_text"].startswith(f"landed: projected {landed['projected']:.3f} [")
    assert landed["verdict_text"].endswith("within the margin 0.02") and landed["covered"] is True

    jumped = _rows()
    for row in jumped[-4:]:  # the last points rise 0.08 above the curve the first half drew
        row["pass_rate"] += 0.08
    missed = half_run_projection(jumped, SETTINGS)
    assert missed["verdict"] == "missed" and missed["error"] < -0.05 and missed["covered"] is False
    assert missed["verdict_text"].endswith("beyond the margin 0.02")

    few = half_run_projection(_rows(num_evals=13), SETTINGS)  # 6 points in the first half
    assert (few["verdict"], few["determined"], few["points_used"]) == ("not_determined", False, 6)
    assert few["projected"] is None and few["error"] is None and few["interval"] is not None
    assert few["projected_not_determined"] is not None
    assert few["verdict_text"].startswith(
        "too few points to say: the first half's fit is not determined (6 points used, at least 8"
    )
    none = half_run_projection(_rows()[:2], SETTINGS)
    assert none["verdict"] == "not_determined"
    assert none["verdict_text"] == "too few points to say: needs at least two curve points after R0, got 1"
