"""How well the fit of the first half of a run predicted its end.

Owns the check users run to decide whether to trust a projection: fit the
eval points whose compute is at most half the run's final compute, project
the pass rate at the final compute, and compare it with the pass rate
measured there. The local stack puts the result in ``summary.json`` and
``asymptote fit`` reports it for every run. Never raises on bad data: a run
that cannot be checked gets a ``reason`` instead, so a summary is always
written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from services.fitter.curve import CurveFitSettings, FitError, bootstrap_intervals, fit_curve
from services.fitter.evals import EvalFileError, records_from_rows, split_baseline


def _result(**values: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "projected": None,
        "measured": None,
        "error": None,
        "interval": None,
        "level": None,
        "points_used": 0,
        "points_in_first_half": 0,
        "half_compute": None,
        "final_compute": None,
        "reason": "",
    }
    out.update(values)
    return out


def project_from_half(
    compute: npt.ArrayLike, pass_rate: npt.ArrayLike, r0: float, settings: CurveFitSettings | None = None
) -> dict[str, Any]:
    """Fit the points with compute <= half the last point's; project to the last point.

    ``compute`` and ``pass_rate`` are a run's curve points in run order (R0's
    point excluded), ``r0`` its step-0 pass rate. Returns ``projected``,
    ``measured`` (the last point's pass rate), ``error`` (projected -
    measured), the bootstrap ``interval`` of the projection at ``level``,
    ``points_used`` (by the fit, after its early cutoff),
    ``points_in_first_half``, ``half_compute``, ``final_compute``, and
    ``reason`` (empty when the projection was made).
    """
    c = np.asarray(compute, dtype=np.float64)
    y = np.asarray(pass_rate, dtype=np.float64)
    if c.ndim != 1 or c.shape != y.shape:
        return _result(reason=f"compute and pass_rate must be 1-D of equal length, got {c.shape} and {y.shape}")
    if c.size < 2:
        return _result(reason=f"needs at least two curve points after R0, got {c.size}")
    final_compute, measured = float(c[-1]), float(y[-1])
    half = final_compute / 2.0
    first_half = c <= half
    out = _result(
        measured=measured,
        final_compute=final_compute,
        half_compute=half,
        points_in_first_half=int(first_half.sum()),
        points_used=int(first_half.sum()),
    )
    settings = settings or CurveFitSettings()
    try:
        fit = fit_curve(c[first_half], y[first_half], r0, settings)
        intervals = bootstrap_intervals(c[first_half], y[first_half], r0, settings, fit, targets=[final_compute])
    except FitError as error:
        out["reason"] = f"first half (compute <= {half:g}): {error}"
        return out
    projected = float(fit.predict(final_compute))
    band = intervals.projection[0]
    out.update(
        projected=projected,
        error=projected - measured,
        interval=[band.low, band.high],
        level=intervals.level,
        points_used=fit.num_points_used,
    )
    return out


def half_run_projection(evals: Sequence[object], settings: CurveFitSettings | None = None) -> dict[str, Any]:
    """The half-run check on a run's ``eval.jsonl`` rows (dicts with ``step``,
    ``policy_version``, ``compute``, ``pass_rate``; other keys ignored).

    R0 is the step-0 row (else the first); the other rows are the curve. A
    bad row (missing key, NaN, negative compute, pass rate outside [0, 1],
    compute decreasing as the steps grow) gives a ``reason`` naming it.
    """
    try:
        records = records_from_rows(evals, "eval.jsonl row")
    except EvalFileError as error:
        return _result(reason=str(error))
    if len(records) < 2:
        return _result(reason=f"needs at least two evaluations (R0's and one more), got {len(records)}")
    baseline, rest = split_baseline(records)
    return project_from_half(
        [record.compute for record in rest], [record.pass_rate for record in rest], baseline.pass_rate, settings
    )
