"""The sweep rule as an Optuna pruner: any Optuna study can stop its trials by their projected asymptote.

Owns the adapter between ``rule.py`` and Optuna's pruning interface (``BasePruner.prune(study, trial)``,
called by ``Trial.should_prune()``). Optuna's facts shape it:

- Trials report one float at an integer step: each eval round is reported as its pass rate at the step
  ``round(compute / compute_per_step)`` (the compute axis in integer units), so Optuna's own views show the
  curve. The rule needs more than that float (each prompt's correct count, for the paired bootstrap), so
  the objective hands every round to ``record``; the pruner keeps the rounds in memory, by trial number.
  Persisting them is the caller's (the runs' eval.jsonl holds them): per-prompt counts are too large for
  trial attributes in a database.
- Studies are single-objective: the objective is A (``objective_value``); B, C_mid, the intervals and the
  outcome go to trial user attributes (``user_attrs``), which the objective sets on its live trial.
- There is no paused state and no heartbeat in ask-and-tell: an "undecided" arm keeps running (adding
  seeds is the controller's), and a trial that stops reporting is simply not judged again.

``prune`` judges at the planned looks only (``SweepSettings.looks``): it returns True for an arm that is
dominated on A or unstable, and False otherwise, including between looks. Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import optuna

from services.sweep.rule import Arm, ArmFit, EvalRound, FloatArray, SweepSettings, Verdict, fit_arm, judge, prompt_draws

if TYPE_CHECKING:
    from optuna.study import Study
    from optuna.trial import FrozenTrial, Trial

_JUDGED_STATES = (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE)
"""Trials whose arms a look compares: running or finished, never pruned or failed ones."""


class AsymptotePruner(optuna.pruners.BasePruner):
    """Prunes a trial whose arm is dominated on A by the leader, or unstable, at a planned look.

    ``num_arms`` is the number of trials the sweep plans (the rule splits its error rate over them);
    ``compute_per_step`` the compute one Optuna step stands for (the axis's unit).
    """

    def __init__(self, settings: SweepSettings, num_arms: int, compute_per_step: float = 1.0) -> None:
        if not compute_per_step > 0:
            raise ValueError(f"compute_per_step must be > 0, got {compute_per_step}")
        settings.look_alpha(num_arms)  # refuses a sweep of fewer than two arms
        self.settings = settings
        self.num_arms = num_arms
        self.compute_per_step = compute_per_step
        self._baselines: dict[int, EvalRound] = {}
        self._rounds: dict[int, list[EvalRound]] = {}
        self._draws: FloatArray | None = None
        self._fits: dict[int, tuple[int, ArmFit]] = {}
        self._looks_judged: dict[int, int] = {}
        self._verdicts: dict[int, Verdict] = {}

    def step(self, compute: float) -> int:
        """The Optuna step of ``compute``: the compute axis in integer units of ``compute_per_step``."""
        return round(compute / self.compute_per_step)

    def record(self, trial: Trial, eval_round: EvalRound) -> None:
        """Keep one eval round of ``trial``'s arm and report its pass rate at its step.

        The round at compute 0 is the arm's step-0 round (R0); it is kept, not reported. Rounds come in
        compute order.
        """
        if eval_round.compute <= 0.0:
            self._baselines[trial.number] = eval_round
            return
        rounds = self._rounds.setdefault(trial.number, [])
        if rounds and eval_round.compute < rounds[-1].compute:
            raise ValueError(
                f"trial {trial.number}: round at compute {eval_round.compute:g} after one at {rounds[-1].compute:g}"
            )
        rounds.append(eval_round)
        trial.report(eval_round.pass_rate, self.step(eval_round.compute))

    def _arm(self, number: int) -> Arm | None:
        baseline, rounds = self._baselines.get(number), self._rounds.get(number)
        if baseline is None or not rounds:
            return None
        return Arm(f"trial{number}", baseline, tuple(rounds))

    def _fit(self, number: int, arm: Arm) -> ArmFit:
        cached = self._fits.get(number)
        if cached is not None and cached[0] == len(arm.rounds):
            return cached[1]
        if self._draws is None:
            self._draws = prompt_draws(arm.baseline.correct.size, self.settings)
        fitted = fit_arm(arm, self.settings, self._draws)
        self._fits[number] = (len(arm.rounds), fitted)
        return fitted

    def prune(self, study: Study, trial: FrozenTrial) -> bool:
        """Judge ``trial`` at the first planned look its compute has passed and not been judged at."""
        arm = self._arm(trial.number)
        if arm is None:
            return False
        due = sum(look <= arm.compute * (1 + 1e-9) for look in self.settings.looks)
        if due <= self._looks_judged.get(trial.number, 0):
            return False
        self._looks_judged[trial.number] = due
        fits = []
        for other in study.get_trials(deepcopy=False, states=_JUDGED_STATES):
            other_arm = arm if other.number == trial.number else self._arm(other.number)
            if other_arm is not None:
                fits.append(self._fit(other.number, other_arm))
        verdict = judge(fits, self.settings, self.num_arms)[arm.name]
        self._verdicts[trial.number] = verdict
        return verdict.stop

    def verdict(self, number: int) -> Verdict | None:
        """The outcome of trial ``number`` at its latest look; None before its first."""
        return self._verdicts.get(number)

    def objective_value(self, number: int) -> float:
        """The value a trial's objective returns: its fitted A, else its last pass rate (a trial too young
        to fit)."""
        cached = self._fits.get(number)
        if cached is not None and cached[1].fit is not None:
            return cached[1].fit.a
        arm = self._arm(number)
        if arm is None:
            raise ValueError(f"trial {number} has recorded no eval round after its step-0 round")
        fitted = self._fit(number, arm)
        return fitted.fit.a if fitted.fit is not None else arm.rounds[-1].pass_rate

    def user_attrs(self, number: int) -> dict[str, float | str | bool | None]:
        """What the study keeps beside the objective: the outcome and its reason, A with its interval, B and
        C_mid, and whether the fit is determined (JSON values, for ``Trial.set_user_attr``)."""
        verdict = self._verdicts.get(number)
        cached = self._fits.get(number)
        fitted = cached[1] if cached is not None else None
        fit = fitted.fit if fitted is not None else None
        intervals = fitted.intervals if fitted is not None else None
        return {
            "sweep_outcome": verdict.outcome if verdict is not None else None,
            "sweep_reason": verdict.reason if verdict is not None else None,
            "determined": bool(fitted is not None and fitted.judged is not None and fitted.judged.determined),
            "a": fit.a if fit is not None else None,
            "a_low": intervals.a.low if intervals is not None else None,
            "a_high": intervals.a.high if intervals is not None else None,
            "b": fit.b if fit is not None else None,
            "c_mid": fit.c_mid if fit is not None else None,
        }
