"""How well the fit of the first half of a run predicted its end.

Owns the check users run to decide whether to trust a projection: fit the
eval points whose compute is at most half the run's final compute, project
the pass rate at the final compute, and compare it with the pass rate
measured there. The local stack puts the result in ``summary.json``;
``asymptote fit`` could report it per run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from services.fitter.curve import CurveFitSettings, FitError, bootstrap_intervals, fit_curve


def half_run_projection(
    evals: Sequence[Mapping[str, Any]], settings: CurveFitSettings | None = None
) -> dict[str, Any]:
    """Fit on compute <= half the final compute; project to the final compute.

    ``evals``: eval.jsonl rows (``policy_version``, ``compute``, ``pass_rate``).
    Returns ``projected``, ``measured``, ``error`` (projected - measured),
    the interval of the projection, the points used, or ``reason`` when no
    fit was possible.
    """
    rows = sorted(evals, key=lambda r: float(r["compute"]))
    r0_rows = [r for r in rows if int(r["policy_version"]) == 0]
    out: dict[str, Any] = {"projected": None, "measured": None, "error": None, "interval": None,
                           "points_used": 0, "half_compute": None, "reason": ""}
    if not r0_rows or len(rows) < 2:
        out["reason"] = "needs the step-0 evaluation and at least one more"
        return out
    final = rows[-1]
    final_compute = float(final["compute"])
    half = final_compute / 2
    first_half = [r for r in rows if 0 < float(r["compute"]) <= half]
    out.update(measured=float(final["pass_rate"]), half_compute=half, points_used=len(first_half))
    if not math.isfinite(final_compute) or final_compute <= 0:
        out["reason"] = f"final compute is {final_compute}"
        return out
    compute = np.array([float(r["compute"]) for r in first_half])
    pass_rate = np.array([float(r["pass_rate"]) for r in first_half])
    r0 = float(r0_rows[0]["pass_rate"])
    settings = settings or CurveFitSettings()
    try:
        fit = fit_curve(compute, pass_rate, r0, settings)
        intervals = bootstrap_intervals(compute, pass_rate, r0, settings, fit, targets=[final_compute])
    except FitError as exc:
        out["reason"] = str(exc)
        return out
    projected = float(fit.predict(np.array([final_compute]))[0])
    out.update(projected=projected, error=projected - out["measured"])
    band = intervals.projection[0]
    out["interval"] = [float(band.low), float(band.high)]
    out["level"] = intervals.level
    return out
