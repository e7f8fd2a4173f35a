"""``asymptote sweep promote DIR --budget X``: the winner continued to a larger budget, its forecast first.

Owns the paper's extrapolation made routine: the sweep's pick (or ``--arm``) is fitted on all its seeds'
rounds as the sweep fits it, and its forecast at the new budget (A with its interval, the projected pass
rate at X with its band) is written to ``DIR/promote/<arm>.json`` before anything runs. Then the arm's
furthest run continues (``asymptote up --resume``, its step limit raised to reach X at its pace so far),
each new eval round is set against the forecast curve at its compute (``<arm>.jsonl``: observed,
forecast, the curve's band, the round's eval noise, error, and whether the observation lies inside the
band widened by that noise), and the run is stopped cleanly at X. Started again with the
same budget it goes on from the same forecast (never refitted on the rounds it is judged against).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import norm

from asymptote.errors import ConfigError
from services.fitter.curve import predict
from services.sweep.controller import atomic_write, read_summary
from services.sweep.launcher import Launcher, LocalLauncher, RunPaths, asymptote_up
from services.sweep.replay import SEED_DIR, read_run
from services.sweep.rule import Arm, SweepSettings, fit_arm, pool, prompt_draws
from services.sweep.spec import SweepSpec

HEADROOM = 1.5
"""The step limit of a promoted run: this many times the steps its pace so far needs to reach the budget
(it is stopped at the budget; the limit only keeps a run whose pace drops from ending short)."""


def _arm_runs(directory: Path, arm: str) -> list[Path]:
    runs = [
        p / "run"
        for p in sorted((directory / "runs").glob(f"{arm}-s*"))
        if (m := SEED_DIR.match(p.name)) and m["arm"] == arm and (p / "run" / "eval.jsonl").exists()
    ]
    if not runs:
        raise ConfigError(f"{directory}: arm {arm!r} has no run with eval rounds")
    return runs


def forecast(directory: Path, arm: str, budget: float, settings: SweepSettings) -> dict[str, Any]:
    """The arm's forecast at ``budget`` from all its seeds' rounds: A and its interval, B, C_mid, R0, the
    projected pass rate and its band, whether the fit is determined."""
    runs = [read_run(path, arm)[0] for path in _arm_runs(directory, arm)]
    seeds = [Arm(str(r.path), r.rounds[0], tuple(x for x in r.rounds[1:] if x.compute > 0)) for r in runs]
    fitted = fit_arm(pool(arm, seeds), settings, prompt_draws(runs[0].rounds[0].correct.size, settings), seeds)
    if fitted.fit is None:
        raise ConfigError(f"arm {arm!r} has no fit to forecast from: {fitted.why_not or fitted.unstable}")
    fit = fitted.fit
    record = {
        "arm": arm,
        "budget": budget,
        "from_compute": max(s.compute for s in seeds),
        "a": fit.a,
        "a_interval": None if fitted.intervals is None else [fitted.intervals.a.low, fitted.intervals.a.high],
        "b": fit.b,
        "c_mid": fit.c_mid,
        "r0": fit.r0,
        "projected": float(predict(budget, fit.a, fit.b, fit.c_mid, fit.r0)),
        "determined": bool(fitted.judged is not None and fitted.judged.determined),
        "why_not": fitted.unstable.text if fitted.unstable else fitted.why_not,
        "band_samples": None
        if fitted.intervals is None
        else {
            "level": fitted.intervals.level,
            "a": fitted.intervals.a_samples.tolist(),
            "b": fitted.intervals.b_samples.tolist(),
            "c_mid": fitted.intervals.c_mid_samples.tolist(),
        },
        "recorded_unix_s": time.time(),
    }
    record["band"] = _band(record, budget)
    return record


def _band(record: dict[str, Any], compute: float) -> list[float] | None:
    """The forecast curve's band at ``compute``: the bootstrap fits' percentiles at the fit's level."""
    samples = record["band_samples"]
    if samples is None:
        return None
    a, b, c_mid = (np.asarray(samples[k]) for k in ("a", "b", "c_mid"))
    curves = predict(compute, a, b, c_mid, record["r0"])
    tail = (1.0 - samples["level"]) / 2.0
    return [float(np.quantile(curves, tail)), float(np.quantile(curves, 1.0 - tail))]


def _expected(record: dict[str, Any], band: list[float] | None, noise_sd: float) -> list[float] | None:
    """Where a round's observation is expected: the curve's band widened by the round's own eval noise at
    the same level (a prediction interval, not the curve's confidence band)."""
    if band is None:
        return None
    z = float(norm.ppf(1.0 - (1.0 - record["band_samples"]["level"]) / 2.0))
    return [band[0] - z * noise_sd, band[1] + z * noise_sd]


def promote(
    directory: Path,
    budget: float,
    arm: str | None = None,
    launcher: Launcher | None = None,
    command: Callable[[RunPaths, bool, int], list[str]] | None = None,
    poll_s: float = 2.0,
    report: Callable[[dict[str, Any]], None] = lambda row: None,
) -> dict[str, Any]:
    """Continue the sweep in ``directory``'s pick (or ``arm``) to ``budget`` (module docstring); the final
    comparison of forecast and observation."""
    held = json.loads((directory / "spec.json").read_text(encoding="utf-8"))
    settings = SweepSpec.model_validate(held["spec"]).settings
    if budget <= settings.budget_compute:
        raise ConfigError(f"--budget {budget:g} is not above the sweep's budget per arm {settings.budget_compute:g}")
    if arm is None:
        arm = read_summary(directory).get("pick")
        if arm is None:
            raise ConfigError(f"{directory}: the sweep picked no arm (none determined to lead); give --arm")
    out = directory / "promote"
    out.mkdir(exist_ok=True)
    record_path = out / f"{arm}.json"
    if record_path.exists():
        record = json.loads(record_path.read_text(encoding="utf-8"))
        if record["budget"] != budget:
            raise ConfigError(f"{record_path}: {arm} was promoted to {record['budget']:g}, not {budget:g}")
    else:
        record = forecast(directory, arm, budget, settings)
        atomic_write(record_path, json.dumps(record, indent=2))  # before the run goes on: a forecast, not a fit
    first = max((read_run(p, arm)[0] for p in _arm_runs(directory, arm)), key=lambda r: r.rounds[-1].compute)
    run_dir = first.path
    paths = RunPaths(run_dir.parent)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text(encoding="utf-8").splitlines() if metrics.exists() else []
    steps_done = sum(1 for line in lines if line.strip())
    per_step = first.rounds[-1].compute / max(steps_done, 1)
    max_steps = steps_done + math.ceil(HEADROOM * (budget - first.rounds[-1].compute) / per_step)
    build = command or (lambda run, resume, steps: [*asymptote_up(run, resume), "--max-steps", str(steps)])
    launcher = launcher or LocalLauncher(lambda run, resume: build(run, resume, max_steps))
    log_path = out / f"{arm}.jsonl"
    seen = {json.loads(line)["compute"] for line in log_path.read_text().splitlines()} if log_path.exists() else set()
    if launcher.status(paths) != "running":
        launcher.resume(paths)
    last: dict[str, Any] | None = None
    while True:
        alive = launcher.status(paths) == "running"  # before the read: a run that ended has written its rows
        run = read_run(run_dir, arm)[0]
        for r in run.rounds:
            if r.compute <= record["from_compute"] or r.compute in seen:
                continue
            predicted = float(predict(r.compute, record["a"], record["b"], record["c_mid"], record["r0"]))
            band = _band(record, r.compute)
            noise_sd = math.sqrt(r.noise_var)
            expected = _expected(record, band, noise_sd)
            row = {
                "compute": r.compute,
                "observed": r.pass_rate,
                "forecast": predicted,
                "band": band,
                "noise_sd": noise_sd,
                "expected": expected,
                "error": r.pass_rate - predicted,
                "inside": None if expected is None else expected[0] <= r.pass_rate <= expected[1],
            }
            with log_path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
            seen.add(r.compute)
            last = row
            report(row)
        if run.rounds[-1].compute >= budget * (1 - 1e-9) or not alive:
            break
        time.sleep(poll_s)
    while launcher.status(paths) == "running":
        launcher.stop(paths)
        time.sleep(poll_s)
    return {"forecast": {k: v for k, v in record.items() if k != "band_samples"}, "last": last}
