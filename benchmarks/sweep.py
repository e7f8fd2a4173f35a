"""The sweep rule calibrated by replay: simulated sweeps decided by ``services/sweep/rule.py``, and beside them
the same sweeps under Optuna's SuccessiveHalvingPruner on the pass rate at the same step.

Owns the simulated sweep and its figures; the rule is ``services/sweep/rule.py``. A sweep is 8 arms whose
true curves spread as the paper's published fits do (arXiv 2510.13786: A 0.5-0.7, B 1-3, C_mid from before
the first look to the budget, so that some midpoints lie past the fit window until late), two of them a
crossing pair (a fast starter with a lower A, a slow starter with a higher one), each arm's realised A off
its recipe's by the seed spread (0.015), all evaluated on one held-out set of 1,000 prompts x 16 samples
whose per-prompt difficulties (logit offsets, sd 1.5) every arm shares, every 1% of the budget, from one
step-0 round of the shared base model (R0 0.2). Warm-up (the fit's early cutoff) is 10% of the budget;
the looks are geometric by sqrt(2) from there (14%, 20%, 28%, 40%, 57%, 80%) and at 100%.

Figures, against the recipes' true A:

- wrong eliminations: sweeps in which an arm was stopped whose true A is within the margin of the best,
  or above it (target: at most alpha, 0.05); beside it, SuccessiveHalving's (halving at its rungs, 20%, 40%, 80%);
- the chosen arm within the margin of the true best (target: at least 95%), beside the same rate for the
  arm whose run has the highest A, read without error (what one seed an arm allows at best);
- compute spent against running every arm to its budget (target: at most 50%).

    python -m benchmarks.sweep --output DIR [--quick] [--sweeps N]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy.special import expit

from benchmarks.figure import Figure, Target, write_and_print
from services.fitter.curve import CurveFitSettings, predict
from services.sweep.rule import (
    SEED_SD_A,
    Arm,
    EvalRound,
    SweepSettings,
    choose,
    fit_arm,
    judge,
    prompt_draws,
)

BENCH_FILE_NAME = "sweep_bench.json"
NUM_ARMS = 8
NUM_PROMPTS = 1000
NUM_SAMPLES = 16
"""The paper's held-out eval: 1,000 prompts x 16 samples."""
NUM_ROUNDS = 100
"""Eval rounds to the budget: every 1% of it (the paper's every 100 steps of a 10k-step run)."""
BUDGET = 1.0
WARMUP = 0.1
R0 = 0.2
PROMPT_SD = 1.5
"""Spread of the held-out prompts' difficulty (logit offsets), shared by every arm."""
NUM_SWEEPS = 500
NUM_SWEEPS_QUICK = 6
NUM_RESAMPLES = 100
"""Resamples of both bootstraps (the fitter's and the paired one): half the default, so that 500 sweeps run in
about half an hour on one core; the seed spread, not the resamples, sets the tails the rule reads."""
SETTINGS = SweepSettings(
    warmup_compute=WARMUP,
    budget_compute=BUDGET,
    num_resamples=NUM_RESAMPLES,
    curve=CurveFitSettings(num_bootstrap_resamples=NUM_RESAMPLES),
)
ROUND_COMPUTE = BUDGET * np.arange(1, NUM_ROUNDS + 1) / NUM_ROUNDS
STEPS_PER_BUDGET = NUM_ROUNDS
"""The Optuna step of a round: its compute in units of 1% of the budget."""
HALVING_MIN_STEPS = 20
"""SuccessiveHalving's first rung: 20% of the budget, twice warm-up; its rungs double from there."""

FloatArray = npt.NDArray[np.float64]
FIGURE_TARGETS = (
    ("sweep_wrong_eliminations", "fraction of sweeps", (Target(of="value", direction="at most", bound=0.05),)),
    ("sweep_chosen_within_margin", "fraction of sweeps", (Target(of="value", direction="at least", bound=0.95),)),
    ("sweep_compute_share", "fraction of compute", (Target(of="value", direction="at most", bound=0.5),)),
)
"""The figures' names, units and targets, for a report that lists them as not run."""


@dataclass(frozen=True)
class SimulatedSweep:
    """One sweep's truth and its measured eval rounds."""

    true_a: FloatArray
    """Each arm's recipe A (what a sweep ranks)."""
    realised_a: FloatArray
    """Each arm's run's A: the recipe's plus its seed's."""
    b: FloatArray
    c_mid: FloatArray
    arms: tuple[Arm, ...]


def _rates_for(target: FloatArray, difficulty: FloatArray) -> FloatArray:
    """Per-prompt pass probabilities (..., P) whose mean over the prompts is ``target`` (...): logit offsets
    ``difficulty`` around a level solved from a table of the mean, so every arm's curve holds exactly."""
    levels = np.linspace(-12.0, 12.0, 2001)
    means = expit(levels[:, None] + difficulty[None, :]).mean(axis=1)
    level = np.interp(target, means, levels)
    rates: FloatArray = expit(level[..., None] + difficulty)
    return rates


def simulate_arms(
    realised_a: npt.ArrayLike,
    b: npt.ArrayLike,
    c_mid: npt.ArrayLike,
    rng: np.random.Generator,
    round_compute: FloatArray = ROUND_COMPUTE,
    num_prompts: int = NUM_PROMPTS,
) -> tuple[Arm, ...]:
    """Arms whose runs follow these curves (R0 0.2), measured on one held-out set of ``num_prompts`` prompts x
    ``NUM_SAMPLES`` samples with shared difficulties, at ``round_compute``, from one step-0 round of the base
    model (every arm's R0)."""
    difficulty = rng.normal(0.0, PROMPT_SD, num_prompts)
    base = rng.binomial(NUM_SAMPLES, _rates_for(np.array(R0), difficulty))
    baseline = EvalRound(0.0, base.astype(np.int64), NUM_SAMPLES)
    a_ = np.asarray(realised_a, dtype=np.float64)
    curves = predict(
        round_compute[None, :],
        a_[:, None],
        np.asarray(b, dtype=np.float64)[:, None],
        np.asarray(c_mid, dtype=np.float64)[:, None],
        baseline.pass_rate,
    )
    correct = rng.binomial(NUM_SAMPLES, _rates_for(curves, difficulty)).astype(np.int64)  # (arms, rounds, P)
    return tuple(
        Arm(
            f"arm{i}",
            baseline,
            tuple(EvalRound(float(c), correct[i, j], NUM_SAMPLES) for j, c in enumerate(round_compute)),
        )
        for i in range(a_.size)
    )


def simulate_sweep(seed: int) -> SimulatedSweep:
    """Eight arms on one held-out set, as described in the module docstring, from ``seed``."""
    rng = np.random.default_rng(seed)
    true_a = rng.uniform(0.5, 0.7, NUM_ARMS)
    b = rng.uniform(1.0, 3.0, NUM_ARMS)
    c_mid = BUDGET * np.exp(rng.uniform(np.log(0.05), np.log(1.0), NUM_ARMS))
    # The crossing pair: a slow starter with a high A and a fast starter with a lower one.
    true_a[0], c_mid[0], b[0] = rng.uniform(0.64, 0.70), BUDGET * rng.uniform(0.3, 0.6), rng.uniform(1.5, 3.0)
    true_a[1], c_mid[1], b[1] = (
        true_a[0] - rng.uniform(0.04, 0.08),
        BUDGET * rng.uniform(0.03, 0.08),
        rng.uniform(1.0, 2.0),
    )
    realised_a = true_a + rng.normal(0.0, SEED_SD_A, NUM_ARMS)
    return SimulatedSweep(true_a, realised_a, b, c_mid, simulate_arms(realised_a, b, c_mid, rng))


def _upto(arm: Arm, compute: float) -> Arm:
    return Arm(arm.name, arm.baseline, tuple(r for r in arm.rounds if r.compute <= compute * (1 + 1e-9)), arm.seed_sd_a)


def run_rule(sweep: SimulatedSweep, settings: SweepSettings = SETTINGS) -> dict[str, Any]:
    """The rule on one sweep, look by look: each arm's stop compute and outcome, and the arm chosen."""
    draws = prompt_draws(NUM_PROMPTS, settings)
    stopped: dict[str, tuple[float, str]] = {}
    chosen: str | None = None
    fits_made = 0
    for look in settings.looks:
        # A look falls at the first eval round at or past its compute, as the pruner sees it.
        at = float(ROUND_COMPUTE[min(int(np.searchsorted(ROUND_COMPUTE, look * (1 - 1e-9))), NUM_ROUNDS - 1)])
        fits = [fit_arm(_upto(arm, at), settings, draws) for arm in sweep.arms if arm.name not in stopped]
        fits_made += len(fits)
        verdicts = judge(fits, settings, NUM_ARMS)
        for name, verdict in verdicts.items():
            if verdict.stop:
                stopped[name] = (at, verdict.outcome)
        if look == settings.budget_compute:
            chosen = choose(fits, verdicts)
    spent = {arm.name: stopped.get(arm.name, (settings.budget_compute, ""))[0] for arm in sweep.arms}
    return {"stopped": stopped, "spent": spent, "chosen": chosen, "fits": fits_made}


def run_successive_halving(sweep: SimulatedSweep) -> dict[str, Any]:
    """The same sweep under Optuna's SuccessiveHalvingPruner (asynchronous successive halving) on the
    round's pass rate, halving at its rungs (min_resource 20 steps, reduction factor 2: 20%, 40%, 80%), the arms
    stepping together round by round through ask-and-tell; the pick is the best final pass rate."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pruner = optuna.pruners.SuccessiveHalvingPruner(
        min_resource=HALVING_MIN_STEPS, reduction_factor=2, min_early_stopping_rate=0
    )
    study = optuna.create_study(direction="maximize", pruner=pruner, storage=optuna.storages.InMemoryStorage())
    trials = [study.ask() for _ in sweep.arms]
    alive = dict(zip((arm.name for arm in sweep.arms), trials))
    spent: dict[str, float] = {}
    last: dict[str, float] = {}
    look_steps = {HALVING_MIN_STEPS * 2**k for k in range(3)}
    for j in range(NUM_ROUNDS):
        step = j + 1
        for arm in sweep.arms:
            trial = alive.get(arm.name)
            if trial is None:
                continue
            rate = arm.rounds[j].pass_rate
            trial.report(rate, step)
            last[arm.name] = rate
            # The pruner reads the value at the step it is asked at: asked at the looks only, as the rule is.
            if step in look_steps and trial.should_prune():
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                spent[arm.name] = arm.rounds[j].compute
                del alive[arm.name]
    for name, trial in alive.items():
        study.tell(trial, last[name])
        spent[name] = BUDGET
    chosen = max(alive, key=lambda name: last[name]) if alive else None
    return {"stopped": {n: (spent[n], "pruned") for n in spent if n not in alive}, "spent": spent, "chosen": chosen}


def _oracle_pick(sweep: SimulatedSweep) -> str:
    """The arm whose run has the highest A, read without error: the best any rule that sees one seed an arm
    can pick, since the seed's part of A is indistinguishable from the recipe's."""
    return sweep.arms[int(np.argmax(sweep.realised_a))].name


def score(sweep: SimulatedSweep, result: dict[str, Any], margin: float) -> dict[str, Any]:
    """Wrong eliminations (arms stopped whose true A is within the margin of the best, or above it), whether
    the chosen arm is within the margin of the true best, and the compute share spent."""
    index = {arm.name: i for i, arm in enumerate(sweep.arms)}
    best = float(sweep.true_a.max())
    wrong = [
        n for n, (_, why) in result["stopped"].items() if why != "unstable" and sweep.true_a[index[n]] >= best - margin
    ]
    chosen = result["chosen"]
    return {
        "wrong": len(wrong),
        "eligible": int((sweep.true_a >= best - margin).sum()),
        "unstable": sum(why == "unstable" for _, why in result["stopped"].values()),
        "chosen_within": chosen is not None and bool(sweep.true_a[index[chosen]] >= best - margin),
        "chosen_none": chosen is None,
        "share": sum(result["spent"].values()) / (NUM_ARMS * BUDGET),
    }


def bench_sweep(num_sweeps: int, seed: int = 0, partial: Path | None = None) -> list[Figure]:
    """The rule and SuccessiveHalving on ``num_sweeps`` simulated sweeps (seeds ``seed`` onwards); with
    ``partial``, the figures so far are written there every 10 sweeps, so a long run that is stopped
    still says what it measured."""
    margin = SETTINGS.margin
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    rule_s = 0.0
    for k in range(num_sweeps):
        sweep = simulate_sweep(seed + k)
        t0 = time.perf_counter()
        ours = run_rule(sweep)
        rule_s += time.perf_counter() - t0
        theirs = run_successive_halving(sweep)
        oracle = _oracle_pick(sweep)
        best = float(sweep.true_a.max())
        rows.append(
            {
                "seed": seed + k,
                "rule": score(sweep, ours, margin),
                "halving": score(sweep, theirs, margin),
                "oracle_within": bool(sweep.true_a[int(oracle.removeprefix("arm"))] >= best - margin),
                "fits": ours["fits"],
                "stopped": {n: [c, why] for n, (c, why) in ours["stopped"].items()},
            }
        )
        if partial is not None and len(rows) % 10 == 0:
            write_and_print(_figures(rows, rule_s, time.perf_counter() - started), partial)
    return _figures(rows, rule_s, time.perf_counter() - started)


def _figures(rows: list[dict[str, Any]], rule_s: float, wall_s: float) -> list[Figure]:
    margin, alpha, num_sweeps = SETTINGS.margin, SETTINGS.alpha, len(rows)

    def rate(side: str, key: str) -> float:
        return float(np.mean([row[side][key] > 0 if key == "wrong" else row[side][key] for row in rows]))

    ours_wrong, theirs_wrong = rate("rule", "wrong"), rate("halving", "wrong")
    ours_share, theirs_share = rate("rule", "share"), rate("halving", "share")
    ours_within, theirs_within = rate("rule", "chosen_within"), rate("halving", "chosen_within")
    oracle_within = float(np.mean([row["oracle_within"] for row in rows]))
    arms_wrong = sum(row["rule"]["wrong"] for row in rows) / max(1, sum(row["rule"]["eligible"] for row in rows))
    fits = sum(row["fits"] for row in rows)
    sizes = f"{num_sweeps} sweeps of {NUM_ARMS} arms, {NUM_PROMPTS} prompts x {NUM_SAMPLES} samples"
    details = {
        "num_sweeps": num_sweeps,
        "looks": list(SETTINGS.looks),
        "look_alpha": SETTINGS.look_alpha(NUM_ARMS),
        "margin": margin,
        "alpha": alpha,
        "seed_sd_a": SEED_SD_A,
        "rule_wrong_arms_over_eligible": arms_wrong,
        "halving_chosen_within_margin": theirs_within,
        "highest_realised_a_within_margin": oracle_within,
        "rule_chosen_none": rate("rule", "chosen_none"),
        "rule_unstable_false_alarms": sum(row["rule"]["unstable"] for row in rows),
        "rule_fits": fits,
        "rule_s": rule_s,
        "rule_s_per_arm_fit": rule_s / max(1, fits),
        "wall_s": wall_s,
        "rows": rows,
    }
    return [
        Figure(
            name="sweep_wrong_eliminations",
            value=ours_wrong,
            unit="fraction of sweeps",
            baseline=f"SuccessiveHalving on the pass rate at its rungs: {theirs_wrong:.3f}",
            measured=f"sweeps with an arm stopped within {margin:g} of the true best A, or above it ({sizes}); "
            f"{arms_wrong:.3f} of such arms",
            targets=(Target(of="value", direction="at most", bound=alpha),),
            details=details,
        ),
        Figure(
            name="sweep_chosen_within_margin",
            value=ours_within,
            unit="fraction of sweeps",
            baseline=f"the highest realised A, read without error: {oracle_within:.3f}; SuccessiveHalving: {theirs_within:.3f}",
            measured=f"the chosen arm's true A within {margin:g} of the best ({sizes})",
            targets=(Target(of="value", direction="at least", bound=0.95),),
        ),
        Figure(
            name="sweep_compute_share",
            value=ours_share,
            unit="fraction of compute",
            ratio=ours_share / theirs_share,
            baseline=f"SuccessiveHalving: {theirs_share:.3f} of running every arm to its budget",
            measured=f"compute spent against every arm to its budget ({sizes}); rule {rule_s:.0f} s "
            f"({rule_s / max(1, fits) * 1e3:.0f} ms an arm's look)",
            targets=(Target(of="value", direction="at most", bound=0.5),),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME}")
    parser.add_argument("--quick", action="store_true", help=f"{NUM_SWEEPS_QUICK} sweeps (for tests)")
    parser.add_argument("--sweeps", type=int, default=None, help=f"number of simulated sweeps (default {NUM_SWEEPS})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    num_sweeps = args.sweeps or (NUM_SWEEPS_QUICK if args.quick else NUM_SWEEPS)
    args.output.mkdir(parents=True, exist_ok=True)
    figures = bench_sweep(num_sweeps, partial=args.output / f"partial_{BENCH_FILE_NAME}")
    write_and_print(figures, args.output / BENCH_FILE_NAME)
    print(json.dumps({k: v for k, v in figures[0].details.items() if k != "rows"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
