"""What a live fitter's ``fit.json`` must say about the ``eval.jsonl`` it was fitted to.

``fit.json`` is the Projection the fitter's collector last computed
(``services/fitter/collector.py``: the protobuf's fields by name, plus
``run`` and ``num_points``), fitted to the points of ``eval.jsonl`` with
the point at policy version 0 as R0. ``check_fit`` holds the two files
against each other and against the curve

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)

so a test that reads a run's fit checks numbers, not the presence of keys.
``known_eval_rows`` writes a series with a known curve, for tests that need
the fitter to publish a fit whatever a short run learned; ``eval_round`` is
one round's eval results as generators publish them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from asymptote.contracts.v1 import rollout_pb2
from services.fitter.collector import Point
from services.fitter.curve import predict
from services.fitter.decision import A_BOUND_TOLERANCE, MAX_C_MID_SPREAD, MIN_POINTS_DETERMINED

REL_TOL = 1e-9
"""The fitter computes its projections with ``curve.predict`` too: they match to rounding."""
RMSE_REL_TOL = 1e-6
"""The fitter's RMSE comes from its least-squares kernels: a different summation order."""


def _require(condition: bool, message: str) -> None:
    """An AssertionError with ``message`` unless ``condition`` (kept under ``python -O`` too)."""
    if not condition:
        raise AssertionError(message)


def _finite(fit: Mapping[str, Any], name: str) -> float:
    value = fit.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AssertionError(f"fit.json {name} is {value!r}: an ok fit needs a finite number")
    return float(value)


def _interval(fit: Mapping[str, Any], name: str) -> tuple[float, float]:
    interval = fit.get(name)
    if not isinstance(interval, Mapping):
        raise AssertionError(f"fit.json {name} is {interval!r}: an ok fit needs an interval")
    low, high = _finite(interval, "low"), _finite(interval, "high")
    _require(low <= high, f"fit.json {name} is [{low}, {high}]: low above high")
    return low, high


def point_estimates(fit: Mapping[str, Any]) -> dict[str, Any]:
    """A fit.json fit's ``a``, ``b`` and ``c_mid``: stated bare by a determined fit, kept apart under
    ``not_determined_point_estimates`` by one that is not."""
    where = fit if fit.get("determined") else fit.get("not_determined_point_estimates") or {}
    return {name: where.get(name) for name in ("a", "b", "c_mid")}


def check_fit(fit: Mapping[str, Any], evals: Sequence[Mapping[str, Any]]) -> None:
    """Raise AssertionError unless ``fit`` (fit.json) is the fitter's fit of ``evals`` (eval.jsonl rows).

    Always: ``ok`` and ``determined`` are bools, ``num_points`` is the number
    of eval rows, and a fit that is not determined says why
    (``why_not_determined``). Not ok: a non-empty ``reason``, which is why
    it is not determined; with an R0 row, ``r0`` is its pass rate and
    ``num_points_used`` counts the rows after it (what was offered).
    Ok: an empty reason; A, B, C_mid (for a fit not determined, under
    ``not_determined_point_estimates``, and nowhere bare), R0 and the RMSE finite, A in [0, 1],
    B and C_mid > 0, R0 the pass rate of the row at policy version 0; the
    points used at most the rows after R0; the RMSE over those points (the
    cutoff keeps the points of largest compute) and every projected pass
    rate recomputed from the fit's own parameters; every interval ordered.
    Determined (``decision.determination``): enough points, nothing at a
    bound, A's interval clear of R0 and of 1, C_mid's at most
    ``MAX_C_MID_SPREAD`` wide, and advice read off it; not determined: the
    advice is "continue" for that reason.
    """
    _require(isinstance(fit.get("ok"), bool), f"fit.json ok is {fit.get('ok')!r}: it must be true or false")
    _require(
        fit.get("num_points") == len(evals),
        f"fit.json num_points is {fit.get('num_points')!r}, eval.jsonl holds {len(evals)} rows",
    )
    rows = sorted(evals, key=lambda row: int(row["policy_version"]))
    r0_rows = [row for row in rows if row["policy_version"] == 0]
    after = [row for row in rows if row["policy_version"] > 0]
    reason = fit.get("reason")
    determined, why = fit.get("determined"), fit.get("why_not_determined")
    _require(isinstance(determined, bool), f"fit.json determined is {determined!r}: it must be true or false")
    if determined:
        _require(why == "", f"a determined fit has no why_not_determined, got {why!r}")
    else:
        _require(isinstance(why, str) and bool(why.strip()), f"a fit not determined must say why, got {why!r}")

    if not fit["ok"]:
        _require(isinstance(reason, str) and bool(reason.strip()), f"a failed fit needs a reason, got {reason!r}")
        _require(not determined and why == reason, f"a failed fit is not determined because of {reason!r}: {why!r}")
        if r0_rows:
            _require(
                fit.get("r0") == r0_rows[0]["pass_rate"],
                f"failed fit r0 {fit.get('r0')!r} is not R0, the pass rate at version 0 ({r0_rows[0]['pass_rate']})",
            )
            _require(
                fit.get("num_points_used") == len(after),
                f"failed fit num_points_used {fit.get('num_points_used')!r}: {len(after)} points were offered",
            )
        return

    _require(not reason, f"an ok fit has no reason, got {reason!r}")
    _require(bool(r0_rows), "an ok fit needs R0, an eval row at policy version 0")
    # An undetermined fit's point values are kept apart, labelled: they are not a forecast.
    estimates = fit if determined else fit.get("not_determined_point_estimates")
    if not isinstance(estimates, Mapping):
        raise AssertionError(
            f"an undetermined fit keeps its point values under not_determined_point_estimates, got {estimates!r}"
        )
    if not determined:
        _require(
            not any(name in fit for name in ("a", "b", "c_mid")),
            "an undetermined fit states no bare a, b or c_mid",
        )
    a, b, c_mid = (_finite(estimates, name) for name in ("a", "b", "c_mid"))
    r0 = _finite(fit, "r0")
    _require(0.0 <= a <= 1.0, f"fit.json a = {a}: a pass rate lies in [0, 1]")
    _require(b > 0.0 and c_mid > 0.0, f"fit.json b = {b}, c_mid = {c_mid}: both must be > 0")
    _require(r0 == r0_rows[0]["pass_rate"], f"fit.json r0 {r0} is not the pass rate at version 0 ({r0_rows[0]})")
    for name in ("a_interval", "b_interval", "c_mid_interval"):
        _interval(fit, name)

    used = fit.get("num_points_used")
    if not (isinstance(used, int) and 3 <= used <= len(after)):
        raise AssertionError(f"fit.json num_points_used {used!r}: three to {len(after)} (the rows after R0)")
    # The early cutoff is a compute threshold and compute grows along the run:
    # the points used are the last ``used`` rows.
    tail = after[len(after) - used :]
    compute = np.array([float(row["compute"]) for row in tail])
    pass_rate = np.array([float(row["pass_rate"]) for row in tail])
    _require(bool(np.all(compute > 0)), f"eval rows used by the fit have compute <= 0: {compute}")
    residuals = predict(compute, a, b, c_mid, r0) - pass_rate
    rmse = math.sqrt(float(np.mean(residuals**2)))
    reported = _finite(fit, "rmse")
    _require(
        math.isclose(reported, rmse, rel_tol=RMSE_REL_TOL, abs_tol=1e-12),
        f"fit.json rmse {reported} but its parameters miss the {used} points used by an RMSE of {rmse}",
    )

    projections = fit.get("projections")
    if not (isinstance(projections, list) and projections):
        raise AssertionError(f"an ok fit projects its pass rate, got projections {projections!r}")
    rates = None if determined else estimates.get("projected_pass_rates")
    _require(
        determined or (isinstance(rates, list) and len(rates) == len(projections)),
        f"an undetermined fit keeps one projected pass rate apart per projection, got {rates!r}",
    )
    for i, projection in enumerate(projections):
        target = _finite(projection, "compute")
        _require(target > 0, f"projection {i} at compute {target}: must be > 0")
        expected = float(predict(target, a, b, c_mid, r0))
        _require(
            determined or "pass_rate" not in projection, f"an undetermined fit's projection {i} has a bare pass_rate"
        )
        got = _finite(projection if determined else {"pass_rate": rates[i]}, "pass_rate")  # type: ignore[index]
        _require(
            math.isclose(got, expected, rel_tol=REL_TOL, abs_tol=1e-12),
            f"projection {i} at compute {target:g} says {got}; the fit's own parameters give {expected}",
        )
        _interval(projection, "interval")

    advice = fit.get("recommendation_reason")
    if not determined:
        _require(
            fit.get("recommendation") == "continue" and advice == f"not yet determined: {why}",
            f"a fit not determined ({why}) is advised to continue for that reason, got {fit.get('recommendation')!r}: "
            f"{advice!r}",
        )
        return
    a_low, a_high = _interval(fit, "a_interval")
    c_mid_low, c_mid_high = _interval(fit, "c_mid_interval")
    _require(used >= MIN_POINTS_DETERMINED, f"a determined fit used {used} points, fewer than {MIN_POINTS_DETERMINED}")
    _require(fit.get("identifiable") is True and not fit.get("at_bound"), "a determined fit has nothing at a bound")
    _require(
        r0 + A_BOUND_TOLERANCE < a_low and a_high < 1.0 - A_BOUND_TOLERANCE,
        f"a determined fit's A interval [{a_low}, {a_high}] must lie clear of R0 {r0} and of 1",
    )
    _require(
        c_mid_high <= MAX_C_MID_SPREAD * c_mid_low,
        f"a determined fit's C_mid interval [{c_mid_low}, {c_mid_high}] spans more than {MAX_C_MID_SPREAD:g}x",
    )
    _require(
        isinstance(advice, str) and not advice.startswith("not yet determined"),
        f"a determined fit's advice is read off it, got {advice!r}",
    )


def known_eval_rows(
    num_points: int, a: float, b: float, c_mid: float, r0: float, compute_per_version: float
) -> list[dict[str, Any]]:
    """``eval.jsonl`` rows at policy versions 0 .. num_points - 1 lying on a known curve.

    Version 0 is R0; version v > 0 sits at compute ``v * compute_per_version``
    with the curve's pass rate there, so the fitter recovers (a, b, c_mid).
    """
    rows = []
    for version in range(num_points):
        compute = version * compute_per_version
        rate = r0 if version == 0 else float(predict(compute, a, b, c_mid, r0))
        point = Point(
            step=version,
            policy_version=version,
            compute=compute,
            pass_rate=rate,
            num_prompts=200,
            num_samples=800,
            min_version=version,
            max_version=version,
            unix_s=0.0,
        )
        rows.append(asdict(point))
    return rows


def eval_round(version: int, pass_rate: float, num_prompts: int = 4) -> list[rollout_pb2.EvalResult]:
    """One eval round: ``num_prompts`` results of 100 samples whose mean pass rate is ``pass_rate``."""
    correct = round(pass_rate * 100 * num_prompts)
    per_prompt = [correct // num_prompts + (1 if i < correct % num_prompts else 0) for i in range(num_prompts)]
    return [
        rollout_pb2.EvalResult(
            eval_id=f"eval-{version}",
            task_id=f"eval-{version}-{i}",
            prompt_id=f"p{i}",
            num_samples=100,
            num_correct=n,
            eval_version=version,
            min_version=version,
            max_version=version,
            eval_num_prompts=num_prompts,
            finished_unix_s=1000.0 + version,
        )
        for i, n in enumerate(per_prompt)
    ]
