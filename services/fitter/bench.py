"""A micro-benchmark of the curve fit: how long fit + bootstrap take.

Owns timing only; the maths is ``curve.py``. Synthetic data follow the
paper's 8B ScaleRL curve (arXiv 2510.13786, Table 1) with eval noise, so the
work done matches a real run of the same size.
"""

from __future__ import annotations

import time

import numpy as np

from services.fitter.curve import CurveFitSettings, bootstrap_intervals, fit_curve, predict

# The budget a refit may take: the fitter refits on every eval result, and
# the bootstrap must not lag the eval stream.
TARGET_S = 2.0

_PAPER_A, _PAPER_B, _PAPER_C_MID, _PAPER_R0 = 0.610, 1.92, 2542.0, 0.2
_NOISE_SD = 0.01


def bench_fit(num_points: int = 1000, settings: CurveFitSettings | None = None) -> dict[str, float | int | bool]:
    """Time one fit plus its bootstrap intervals on ``num_points`` synthetic points."""
    settings = settings or CurveFitSettings()
    rng = np.random.default_rng(0)
    compute = np.linspace(3.0 * _PAPER_C_MID / num_points, 3.0 * _PAPER_C_MID, num_points)
    truth = predict(compute, _PAPER_A, _PAPER_B, _PAPER_C_MID, _PAPER_R0)
    pass_rate = np.clip(truth + rng.normal(0.0, _NOISE_SD, num_points), 0.0, 1.0)
    start = time.perf_counter()
    fit = fit_curve(compute, pass_rate, _PAPER_R0, settings)
    fitted = time.perf_counter()
    bootstrap_intervals(compute, pass_rate, _PAPER_R0, settings, fit, [6.0 * _PAPER_C_MID])
    done = time.perf_counter()
    return {
        "num_points": num_points,
        "num_bootstrap_resamples": settings.num_bootstrap_resamples,
        "fit_s": fitted - start,
        "bootstrap_s": done - fitted,
        "total_s": done - start,
        "target_s": TARGET_S,
        "within_target": done - start < TARGET_S,
    }
