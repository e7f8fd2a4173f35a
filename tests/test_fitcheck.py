"""``check_fit`` passes the fitter's own fit of a known curve and refuses fits that contradict their data."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.fitter.collector import Collector
from services.fitter.compute_axis import ComputeAxis
from services.fitter.curve import CurveFitSettings, predict
from tests.helpers.fitcheck import check_fit, known_eval_rows

A, B, C_MID, R0 = 0.7, 1.6, 3000.0, 0.25
SETTINGS = CurveFitSettings(num_bootstrap_resamples=20)


def fitted(tmp_path: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """fit.json as the live fitter writes it for ``rows``: a restarted collector refits eval.jsonl."""
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    Collector(tmp_path, "known", SETTINGS, (2.0,), ComputeAxis(30.0), plot=False)
    fit: dict[str, Any] = json.loads((tmp_path / "fit.json").read_text())
    return fit


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rows = known_eval_rows(12, A, B, C_MID, R0, compute_per_version=600.0)
    return fitted(tmp_path_factory.mktemp("good"), rows), rows


def test_the_fitters_fit_of_a_known_sigmoid_passes(good: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    fit, rows = good
    assert fit["ok"] and fit["a"] == pytest.approx(A, abs=1e-3) and fit["c_mid"] == pytest.approx(C_MID, rel=1e-2)
    check_fit(fit, rows)


def test_the_fitters_refusal_passes(tmp_path: Path) -> None:
    rows = known_eval_rows(4, A, B, C_MID, R0, compute_per_version=600.0)  # R0 and 3 points: too few
    fit = fitted(tmp_path, rows)
    assert not fit["ok"] and fit["reason"].startswith("too few points")
    check_fit(fit, rows)


def reproject(fit: dict[str, Any]) -> None:
    """Make the projections agree with the (edited) parameters, so only the edit is wrong."""
    for projection in fit["projections"]:
        projection["pass_rate"] = float(predict(projection["compute"], fit["a"], fit["b"], fit["c_mid"], fit["r0"]))


def shifted_a(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit["a"] += 0.05  # the projections and the RMSE were computed with the old A


def projection_not_its_own(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit["projections"][0]["pass_rate"] -= 0.01


def ok_without_parameters(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    for name in ("a", "b", "c_mid"):
        del fit[name]


def ok_with_zero_parameters(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit.update(a=0.0, b=0.0, c_mid=0.0)  # what an unset protobuf prints


def a_above_one(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit["a"] = 1.2
    reproject(fit)


def nan_b(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit["b"] = float("nan")


def rmse_not_its_own(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit["rmse"] += 0.01


def eval_row_changed(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    rows[-1]["pass_rate"] -= 0.1  # not the data the fit was made from


def a_row_missing(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    del rows[5]


def r0_not_version_0(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit["r0"] += 0.01
    reproject(fit)


def no_projection(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit["projections"] = []


def interval_upside_down(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit["a_interval"] = {"low": fit["a_interval"]["high"], "high": fit["a_interval"]["low"] - 0.01}


def more_points_used_than_offered(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit["num_points_used"] = len(rows)


def failed_without_reason(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit.update(ok=False, reason="")


def failed_with_another_r0(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    fit.update(ok=False, reason="no gain over R0", r0=0.0)


def ok_missing(fit: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    del fit["ok"]


BAD: list[Callable[[dict[str, Any], list[dict[str, Any]]], None]] = [
    shifted_a,
    projection_not_its_own,
    ok_without_parameters,
    ok_with_zero_parameters,
    a_above_one,
    nan_b,
    rmse_not_its_own,
    eval_row_changed,
    a_row_missing,
    r0_not_version_0,
    no_projection,
    interval_upside_down,
    more_points_used_than_offered,
    failed_without_reason,
    failed_with_another_r0,
    ok_missing,
]


@pytest.mark.parametrize("spoil", BAD, ids=[f.__name__ for f in BAD])
def test_a_fit_that_contradicts_its_data_is_refused(
    good: tuple[dict[str, Any], list[dict[str, Any]]],
    spoil: Callable[[dict[str, Any], list[dict[str, Any]]], None],
) -> None:
    fit, rows = copy.deepcopy(good)
    spoil(fit, rows)
    with pytest.raises(AssertionError):
        check_fit(fit, rows)
