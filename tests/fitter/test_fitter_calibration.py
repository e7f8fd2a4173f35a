"""Does a fit on the first half of a run predict where it ends, with honest intervals?

Monte Carlo over noisy synthetic runs drawn from known curves: the paper's
Table 1 fits (arXiv 2510.13786; 8B dense A 0.610, B 1.92, C_mid 2542 and
17Bx16 MoE A 0.710, B 1.65, C_mid 4242; Table 1 gives no R0, 0.20 and 0.25
are assumed) and two ablation-like curves (a slow one, B 1.3, and a fast
high one, A 0.85, B 2.5). Each run has 600 evaluations spread evenly up to
3x C_mid with pass-rate noise sd 0.01; the fit sees the first half (up to
1.5x C_mid, minus the early cutoff) and projects to the last point, which
is harder than the paper's own extrapolations (from 20x to 40x C_mid, where
the curve is nearly flat).

The issue's acceptance: the projection lands within 0.02 of the true value
in >= 95% of trials, and the nominal 95% bootstrap interval covers the true
value in >= 90% of trials. Both are checked over all trials, the first also
for every curve alone.

Sizing: the projection's error sd is ~0.008 here, so "within 0.02" is a
2.5-sigma event; with fewer points or more noise it is not reachable (200
points: sd ~0.014; 40 points: ~0.03), a property of the data, not of the
fitter. The percentile bootstrap's spread is ~9% narrower than the true
sampling spread of an extrapolation (checked against a full refit per
resample, which gives the same spread), so the nominal 95% interval covers
~92% (0.915-0.93 per curve over 200 trials each): hence the issue's 0.90
floor, met with a margin of ~1.5 standard errors over 400 trials.
"""

from __future__ import annotations

import numpy as np
import pytest

from services.fitter.curve import CurveFitSettings, bootstrap_intervals, fit_curve, predict

CURVES = {  # name: (A, B, C_mid, R0)
    "paper 8B dense": (0.610, 1.92, 2542.0, 0.20),
    "paper 17Bx16 MoE": (0.710, 1.65, 4242.0, 0.25),
    "slow ablation": (0.550, 1.30, 1500.0, 0.15),
    "fast high ablation": (0.850, 2.50, 800.0, 0.30),
}
NUM_TRIALS_PER_CURVE = 100
NUM_POINTS = 600
NOISE_SD = 0.01


@pytest.mark.slow  # 400 fits with bootstrap intervals: over a minute of CPU
def test_first_half_predicts_the_end_and_the_interval_covers_it(capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(20251015)
    settings = CurveFitSettings()
    assert settings.interval_level == 0.95
    hits: dict[str, int] = {}
    covered: dict[str, int] = {}
    all_errors: list[float] = []
    for name, (a, b, c_mid, r0) in CURVES.items():
        compute = np.linspace(3.0 * c_mid / NUM_POINTS, 3.0 * c_mid, NUM_POINTS)
        first_half = compute <= compute[-1] / 2.0
        end = float(compute[-1])
        truth = float(predict(end, a, b, c_mid, r0))
        errors = []
        covered[name] = 0
        for _ in range(NUM_TRIALS_PER_CURVE):
            pass_rate = np.clip(predict(compute, a, b, c_mid, r0) + rng.normal(0.0, NOISE_SD, NUM_POINTS), 0.0, 1.0)
            fit = fit_curve(compute[first_half], pass_rate[first_half], r0, settings)
            intervals = bootstrap_intervals(compute[first_half], pass_rate[first_half], r0, settings, fit, [end])
            errors.append(float(fit.predict(end)) - truth)
            low, high = intervals.projection[0]
            covered[name] += int(low <= truth <= high)
        error = np.array(errors)
        hits[name] = int(np.sum(np.abs(error) < 0.02))
        all_errors += errors
        with capsys.disabled():
            print(
                f"\ncalibration {name}: {hits[name]}/{NUM_TRIALS_PER_CURVE} projections within 0.02, "
                f"{covered[name]}/{NUM_TRIALS_PER_CURVE} intervals cover the truth; "
                f"error mean {error.mean():+.4f} sd {error.std():.4f}"
            )

    num_trials = NUM_TRIALS_PER_CURVE * len(CURVES)
    total_hits, total_covered = sum(hits.values()), sum(covered.values())
    error = np.array(all_errors)
    with capsys.disabled():
        print(
            f"calibration, all {num_trials} trials: {total_hits}/{num_trials} within 0.02 "
            f"({total_hits / num_trials:.1%}), {total_covered}/{num_trials} covered ({total_covered / num_trials:.1%})"
        )
    assert total_hits / num_trials >= 0.95
    assert total_covered / num_trials >= 0.90
    for name in CURVES:
        assert hits[name] / NUM_TRIALS_PER_CURVE >= 0.95, f"{name}: within 0.02 in {hits[name]} trials"
    # The projection is unbiased to well within its spread.
    assert abs(float(error.mean())) < 0.003
    assert float(error.std()) < 0.012
