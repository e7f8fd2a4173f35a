"""Artefacts that say what is known: every fit is led by whether it is determined, and an undetermined fit's A
and projections appear only as intervals, labelled "not determined".

One test per artefact: the live fitter's ``fit.json``, the local stack's ``summary.json`` and end screen, and
the plot (live and offline drawn to one horizon). ``asymptote fit``'s ``fit.json`` and table are checked in
test_fitter_offline.py (``test_fit_command_leaves_a_fit_at_its_bound_unranked_and_undecided``). The fits: a
run whose midpoint lies past its points (A's interval reaches the cap: not determined) and one that passed
its bend (determined).
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from test_fitter_determined import OPEN

from services.fitter.collector import Collector, Point
from services.fitter.compute_axis import ComputeAxis
from services.fitter.curve import CurveFitSettings, bootstrap_intervals, fit_curve, predict
from services.fitter.decision import determination
from services.fitter.plot import HORIZON_MULTIPLE, PlotSeries, draw_curves
from services.local.progress import Progress

SETTINGS = CurveFitSettings(num_bootstrap_resamples=100)


def _rows(compute: np.ndarray, pass_rate: np.ndarray, r0: float) -> list[dict[str, Any]]:
    """eval.jsonl rows (FLOPs axis) of a run's points, R0's at version 0."""
    rows = []
    for version, (c, y) in enumerate(zip([0.0, *compute], [r0, *pass_rate])):
        point = Point(version, version, float(c), float(y), 200, 800, version, version, 0.0, compute_unit="flops")
        rows.append(asdict(point))
    return rows


def _steady() -> tuple[np.ndarray, np.ndarray, float]:
    compute = np.linspace(1e12, 3e13, 30)
    rng = np.random.default_rng(5)
    return compute, predict(compute, 0.6, 1.8, 8e12, 0.25) + rng.normal(0.0, 0.01, compute.size), 0.25


def _live(run_dir: Path, points: tuple[np.ndarray, np.ndarray, float], budget: float | None = None) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _rows(*points)))
    Collector(run_dir, run_dir.name, SETTINGS, (2.0, 10.0), ComputeAxis(30.0), plot=False, planned_compute=budget)
    fit: dict[str, Any] = json.loads((run_dir / "fit.json").read_text())
    return fit


def test_the_live_fit_json_leads_with_the_determination_and_states_no_bare_point_values(tmp_path: Path) -> None:
    fit = _live(tmp_path / "open", OPEN.points())
    assert list(fit)[:3] == ["determined", "why_not_determined", "not_determined"]
    assert fit["determined"] is False and fit["not_determined"] == ["a_at_cap"]
    assert not {"a", "b", "c_mid"} & set(fit)
    assert all(set(projection) == {"compute", "interval"} for projection in fit["projections"])
    estimates = fit["not_determined_point_estimates"]
    assert set(estimates) == {"a", "b", "c_mid", "projected_pass_rates"} and len(estimates["projected_pass_rates"]) == 2
    assert fit["a_interval"]["high"] == pytest.approx(1.0, abs=0.005)
    assert "planned_compute" not in fit  # no budget: absent, not 0.0
    assert fit["compute_unit"] == "flops"
    steady = _live(tmp_path / "steady", _steady(), budget=6e13)
    assert steady["determined"] is True and steady["a"] == pytest.approx(0.6, abs=0.03)
    assert steady["planned_compute"] == 6e13 and "not_determined_point_estimates" not in steady
    assert all("pass_rate" in projection for projection in steady["projections"])


def test_the_summary_and_the_end_screen_lead_with_the_determination(tmp_path: Path) -> None:
    _live(tmp_path, OPEN.points())
    progress = Progress(tmp_path, max_steps=300)
    out = io.StringIO()
    progress.console = Console(file=out, width=400)
    progress.finish({})
    summary = json.loads((tmp_path / "summary.json").read_text())
    fit = summary["fit"]
    assert list(fit)[:3] == ["determined", "why_not_determined", "not_determined"] and fit["determined"] is False
    assert not {"a", "b", "c_mid", "planned_compute"} & set(fit)
    assert "not_determined_point_estimates" in fit
    check = summary["half_run_projection"]
    assert check["verdict"] == "not_determined" and check["projected"] is None and check["interval"] is not None
    screen = out.getvalue()
    assert "fit (not determined)" in screen and "A in [" in screen
    assert "half-run check" in screen and check["verdict_text"] in " ".join(screen.split())


def _series(name: str, points: tuple[np.ndarray, np.ndarray, float]) -> tuple[PlotSeries, float]:
    compute, pass_rate, r0 = points
    fit = fit_curve(compute, pass_rate, r0, SETTINGS)
    intervals = bootstrap_intervals(compute, pass_rate, r0, SETTINGS, fit)
    return PlotSeries(name, compute, pass_rate, fit, intervals, determination(fit, intervals)), fit.a


def test_the_plot_draws_an_undetermined_fit_as_its_band_with_no_line_at_a() -> None:
    (open_run, open_a), (steady, steady_a) = _series("open", OPEN.points()), _series("steady", _steady())
    for series, a, determined in ((open_run, open_a, False), (steady, steady_a, True)):
        axes = draw_curves([series]).axes[0]
        flat = [line for line in axes.get_lines() if np.ptp(np.asarray(line.get_ydata(), dtype=float)) == 0]
        at_a = [line for line in flat if np.asarray(line.get_ydata(), dtype=float)[0] == pytest.approx(a)]
        shown = axes.get_legend()
        assert shown is not None
        legend = [text.get_text() for text in shown.get_texts()]
        notes = " ".join(text.get_text() for text in axes.texts)
        assert bool(at_a) is determined
        assert any(f"{series.name}: {'determined' if determined else 'not determined'}" in t for t in legend)
        assert ("open: not determined: A's interval" in notes) is not determined
        # The bootstrap band is drawn either way; without a budget the curves are drawn to twice the largest compute, live and offline alike.
        right = max(float(np.asarray(path.vertices)[:, 0].max()) for path in axes.collections[-1].get_paths())
        assert right == pytest.approx(HORIZON_MULTIPLE * float(np.max(np.asarray(series.compute))), rel=1e-9)


def test_the_live_and_offline_plots_draw_to_one_horizon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.fitter import collector, offline

    drawn: list[tuple[str, float | None]] = []
    for module in (collector, offline):
        monkeypatch.setattr(
            module,
            "plot_curves",
            lambda series, path, target_compute=None, name=module.__name__, **_: drawn.append((name, target_compute)),
        )
    for budget in (None, 6e13):
        run_dir = tmp_path / f"run-{budget}"
        run_dir.mkdir()
        (run_dir / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _rows(*_steady())))
        Collector(run_dir, "live", SETTINGS, (2.0, 10.0), ComputeAxis(30.0), plot=True, planned_compute=budget)
        console = Console(file=io.StringIO())
        assert (
            offline.main_fit([run_dir], tmp_path / f"out-{budget}", SETTINGS, [], console=console, budget=budget) == 0
        )
    assert drawn == [
        ("services.fitter.collector", None),
        ("services.fitter.offline", None),
        ("services.fitter.collector", 6e13),
        ("services.fitter.offline", 6e13),
    ]
