"""The learning-speed figure's arithmetic (benchmarks/learning_speed.py) on curves of known shape.

The runs themselves take most of an hour (``python -m benchmarks.learning_speed``); what is checked here is
what turns their curves into the figure: the time read from a fit, the interval, the verdict, the plot.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from benchmarks.learning_speed import (
    Curve,
    figure,
    monotone_time_to_gain,
    plot,
    ratio_interval,
    stack_clock,
    time_to_gain,
)
from services.fitter.curve import fit_curve, predict

R0 = 0.30


def sigmoid_curve(side: str, seed: int, c_mid: float, a: float = 0.6, b: float = 2.0) -> Curve:
    """Points exactly on a sigmoid (R0 at 0 s), every 20 s to 400 s."""
    seconds = [0.0, *np.arange(20.0, 420.0, 20.0).tolist()]
    rates = [R0, *predict(np.array(seconds[1:]), a, b, c_mid, R0).tolist()]
    return Curve(side, seed, seconds, rates, list(range(len(seconds))))


def test_the_time_to_the_gain_is_read_off_the_fitted_curve() -> None:
    curve = sigmoid_curve("stack", 1, c_mid=150.0)
    fit = fit_curve(curve.seconds[1:], curve.pass_rates[1:], R0)
    t = time_to_gain(fit, 0.1)
    assert t is not None
    # The exact curve reaches R0 + 0.1 where (A - R0) / (1 + (C_mid / t)^B) = 0.1: t = C_mid / sqrt(2).
    assert t == pytest.approx(150.0 / math.sqrt(2.0), rel=1e-3)
    assert float(fit.predict(t)) == pytest.approx(R0 + 0.1, abs=1e-9)
    # A curve whose asymptote is under the gain never reaches it.
    assert time_to_gain(fit, 0.31) is None
    # The isotonic cross-check interpolates between the points either side (20 s apart): close to it.
    assert monotone_time_to_gain(curve, R0, 0.1) == pytest.approx(t, rel=0.03)
    assert monotone_time_to_gain(curve, R0, 0.31) is None
    # A point followed by a dip is pooled with it (0.12 and 0.02 over R0 become 0.07 each), so one lucky
    # evaluation does not decide the crossing: it falls between 40 s (0.07) and 60 s (0.20).
    dipped = Curve("stack", 1, [0.0, 20.0, 40.0, 60.0], [R0, R0 + 0.12, R0 + 0.02, R0 + 0.2], [0, 1, 2, 3])
    assert monotone_time_to_gain(dipped, R0, 0.1) == pytest.approx(40.0 + 20.0 * 0.03 / 0.13, rel=1e-9)


def test_the_interval_is_welchs_t_on_the_log_times() -> None:
    base, stack = [300.0, 360.0, 330.0], [200.0, 260.0, 210.0]
    point, low, high = ratio_interval(base, stack)
    # The slow obvious way: scipy's Welch test gives the same t-quantile construction on log times.
    lb, ls = np.log(base), np.log(stack)
    res = stats.ttest_ind(lb, ls, equal_var=False)
    ci = res.confidence_interval(0.95)
    assert point == pytest.approx(math.exp(lb.mean() - ls.mean()), rel=1e-12)
    assert (low, high) == (pytest.approx(math.exp(ci.low), rel=1e-9), pytest.approx(math.exp(ci.high), rel=1e-9))
    assert low < point < high


def test_the_figure_times_each_run_and_pools_r0(tmp_path: Path) -> None:
    curves = [sigmoid_curve("stack", s, c_mid=m) for s, m in ((1, 100.0), (2, 110.0), (3, 95.0))]
    curves += [sigmoid_curve("onpolicy", s, c_mid=m) for s, m in ((1, 200.0), (2, 190.0), (3, 215.0))]
    fig, fits = figure(curves, 0.1)
    times = {k: v["seconds_to_gain"] for k, v in fits.items()}
    assert times["stack-1"] == pytest.approx(100.0 / math.sqrt(2.0), rel=1e-3)
    assert times["onpolicy-3"] == pytest.approx(215.0 / math.sqrt(2.0), rel=1e-3)
    assert fig.details["r0_pooled"] == pytest.approx(R0)
    want = math.exp(np.mean(np.log([200.0, 190.0, 215.0])) - np.mean(np.log([100.0, 110.0, 95.0])))
    assert fig.details["ratio"] == pytest.approx(want, rel=1e-3)
    assert fig.ratio is not None and fig.ratio == pytest.approx(fig.details["interval"][0]) and fig.ratio < want
    assert fig.met is True  # about 2x, with an interval well clear of 1.3x
    assert fig.details["monotone"]["ratio"] == pytest.approx(want, rel=0.05)
    plot(curves, fig.details, tmp_path / "speed.png")
    assert (tmp_path / "speed.png").stat().st_size > 10_000


def test_a_side_that_never_gains_is_a_miss_not_a_figure() -> None:
    curves = [sigmoid_curve("stack", s, c_mid=100.0) for s in (1, 2)]
    curves += [sigmoid_curve("onpolicy", s, c_mid=200.0, a=0.35) for s in (1, 2)]  # asymptote R0 + 0.05
    fig, fits = figure(curves, 0.1)
    assert all(fits[f"onpolicy-{s}"]["seconds_to_gain"] is None for s in (1, 2))
    assert fig.ratio is None and fig.met is False
    assert "never gains 0.1: {'stack': 0, 'onpolicy': 2}" in fig.measured


def test_the_stack_clock_starts_one_median_step_before_the_first(tmp_path: Path) -> None:
    # The learner's first step ends 30 s after it began waiting (the engine started meanwhile), then one
    # every 2 s, but for a 5 s one.
    ends = [1030.0, 1032.0, 1034.0, 1039.0, 1041.0]
    rows = [{"step": v, "policy_version": v, "unix_s": t} for v, t in enumerate(ends, start=1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert stack_clock(tmp_path) == {0: 0.0, 1: 2.0, 2: 4.0, 3: 6.0, 4: 11.0, 5: 13.0}
    rows[2]["policy_version"] = 4  # a restarted learner's versions run ahead of its steps
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RuntimeError, match="its learner restarted"):
        stack_clock(tmp_path)


def test_one_run_that_never_gains_leaves_the_figure_unclaimed() -> None:
    curves = [sigmoid_curve("stack", 1, c_mid=100.0), sigmoid_curve("stack", 2, c_mid=110.0)]
    curves += [sigmoid_curve("stack", 3, c_mid=100.0, a=0.35)]  # this one's asymptote is R0 + 0.05
    curves += [sigmoid_curve("onpolicy", s, c_mid=m) for s, m in ((1, 200.0), (2, 190.0), (3, 215.0))]
    fig, _ = figure(curves, 0.1)
    assert fig.details["runs_without_gain"] == {"stack": 1, "onpolicy": 0}
    want = math.exp(np.mean(np.log([200.0, 190.0, 215.0])) - np.mean(np.log([100.0, 110.0])))
    assert fig.details["ratio"] == pytest.approx(want, rel=1e-3)  # shown, from the two that gained
    assert fig.ratio is None and fig.met is False  # but not claimed
    assert "1 stack and 0 on-policy never did): no figure is claimed" in fig.measured
