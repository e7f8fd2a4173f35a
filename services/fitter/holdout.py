"""How well the fit of the first half of a run predicted its end.

Owns the check users run to decide whether to trust a projection: fit the
eval points whose compute is at most half the run's final compute, project
the pass rate at the final compute, and compare it with the pass rate
measured there. The first half's fit is held to the rule every fit is
(``decision.determination``: at least 8 points, nothing at a bound, A's and
C_mid's intervals pinned down), and the check ends in a verdict: the
projection ``landed`` within the margin of the measured end, ``missed`` it,
or the first half's fit is ``not_determined`` (too few points, or too
little of the curve, to say). The local stack puts the result in
``summary.json`` and on its end screen, and ``asymptote fit`` reports it for
every run. Never raises on bad data: a run that cannot be checked gets a
``reason`` instead, so a summary is always written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from services.fitter.curve import CurveFitSettings, FitError, bootstrap_intervals, fit_curve
from services.fitter.decision import MARGIN, Shortfall, determination
from services.fitter.evals import EvalFileError, records_from_rows, split_baseline

Verdict = Literal["landed", "missed", "not_determined"]
"""The half-run check's answer: within the margin of the measured end, beyond it, or too little to say."""


def _too_little(shortfalls: Sequence[Shortfall]) -> str:
    """How a not-determined verdict begins: too few points, or (enough points) too little of the curve."""
    few = any(shortfall.kind == "few_points" for shortfall in shortfalls)
    return "too few points to say" if few else "too little of the curve to say"


def _result(**values: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "verdict": "not_determined",
        "verdict_text": "",
        "determined": False,
        "why_not_determined": "",
        "margin": MARGIN,
        "covered": None,
        "projected": None,
        "projected_not_determined": None,
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
    if not out["verdict_text"]:
        why = out["why_not_determined"] or out["reason"]
        out["verdict_text"] = f"too few points to say: {why}"
    return out


def project_from_half(
    compute: npt.ArrayLike, pass_rate: npt.ArrayLike, r0: float, settings: CurveFitSettings | None = None
) -> dict[str, Any]:
    """Fit the points with compute <= half the last point's; project to the last point.

    ``compute`` and ``pass_rate`` are a run's curve points in run order (R0's
    point excluded), ``r0`` its step-0 pass rate. Returns ``verdict`` (``Verdict``) and ``verdict_text`` (one
    line saying it), ``determined`` and ``why_not_determined`` (the first half's fit, by
    ``decision.determination``), ``margin``, ``projected`` (None unless the fit is determined; its value is
    then ``projected_not_determined``), ``measured`` (the last point's pass rate), ``error`` (projected -
    measured, None unless determined), the bootstrap ``interval`` of the projection at ``level`` and whether
    it ``covered`` the measured end, ``points_used`` (by the fit, after its early cutoff),
    ``points_in_first_half``, ``half_compute``, ``final_compute``, and ``reason`` (empty when a projection was
    made).
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
    judged = determination(fit, intervals)
    shown = f"[{band.low:.3f}, {band.high:.3f}]"
    out.update(
        interval=[band.low, band.high],
        level=intervals.level,
        points_used=fit.num_points_used,
        covered=band.low <= measured <= band.high,
        determined=judged.determined,
        why_not_determined=judged.why_not,
    )
    if not judged.determined:
        out.update(
            projected_not_determined=projected,
            verdict_text=f"{_too_little(judged.shortfalls)}: the first half's fit is not determined ({judged.why_not}); "
            f"its projection {shown} against the measured {measured:.3f}",
        )
        return out
    miss = projected - measured
    landed = abs(miss) <= MARGIN
    out.update(
        projected=projected,
        error=miss,
        verdict="landed" if landed else "missed",
        verdict_text=f"{'landed' if landed else 'missed'}: projected {projected:.3f} {shown} against the measured "
        f"{measured:.3f}, error {miss:+.3f}, {'within' if landed else 'beyond'} the margin {MARGIN:g}",
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
