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
dominated on A or unstable, and False otherwise, including between looks.

An arm is the trials that share the user attribute ``arm`` (a sweep's seeds of one recipe), or one trial
without it. Its trials are pooled (``rule.pool``: one curve through all their points, the seed term over
sqrt(seeds), each seed's own stability checked), its looks fall at its trials' compute summed over the
seeds it plans, and the
error rate is split over the arms, not the trials. Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import optuna

from services.sweep.rule import (
    Arm,
    ArmFit,
    EvalRound,
    FloatArray,
    SweepSettings,
    Verdict,
    fit_arm,
    judge,
    pool,
    prompt_draws,
    seed_spread,
)

if TYPE_CHECKING:
    from optuna.study import Study
    from optuna.trial import FrozenTrial, Trial

_JUDGED_STATES = (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE)
"""Trials whose arms a look compares: running or finished, never pruned or failed ones."""


ARM_ATTR = "arm"
"""The trial user attribute that names a trial's arm: trials that share it are seeds of one arm."""


class AsymptotePruner(optuna.pruners.BasePruner):
    """Prunes a trial whose arm is dominated on A by the leader, or unstable, at a planned look.

    ``num_arms`` is the number of arms the sweep plans (the rule splits its error rate over them);
    ``compute_per_step`` the compute one Optuna step stands for (the axis's unit); ``seeds`` the runs each
    arm plans. An arm's progress, which its looks fall at, is its trials' compute summed over ``seeds``: its
    seeds run side by side or one after another, each brings the arm to its next looks.
    """

    def __init__(self, settings: SweepSettings, num_arms: int, compute_per_step: float = 1.0, seeds: int = 1) -> None:
        if not compute_per_step > 0:
            raise ValueError(f"compute_per_step must be > 0, got {compute_per_step}")
        if seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {seeds}")
        self.seeds = seeds
        settings.look_alpha(num_arms)  # refuses a sweep of fewer than two arms
        self.settings = settings
        self.num_arms = num_arms
        self.compute_per_step = compute_per_step
        self._baselines: dict[int, EvalRound] = {}
        self._rounds: dict[int, list[EvalRound]] = {}
        self._names: dict[int, str] = {}
        self._draws: FloatArray | None = None
        self._seed_fits: dict[int, tuple[int, ArmFit]] = {}
        self._fits: dict[str, tuple[tuple[tuple[int, int], ...], ArmFit]] = {}
        self._looks_judged: dict[str, int] = {}
        self._verdicts: dict[str, Verdict] = {}

    def step(self, compute: float) -> int:
        """The Optuna step of ``compute``: the compute axis in integer units of ``compute_per_step``."""
        return round(compute / self.compute_per_step)

    @staticmethod
    def arm_name(number: int, user_attrs: dict[str, object]) -> str:
        """A trial's arm: its ``arm`` user attribute, else the trial alone (``trial<number>``)."""
        name = user_attrs.get(ARM_ATTR)
        return str(name) if name is not None else f"trial{number}"

    def record(self, trial: Trial, eval_round: EvalRound) -> None:
        """Keep one eval round of ``trial``'s arm and report its pass rate at its step.

        The round at compute 0 is the trial's step-0 round (R0); it is kept, not reported. Rounds come in
        compute order. Set the trial's ``arm`` attribute before its first round.
        """
        self._names[trial.number] = self.arm_name(trial.number, trial.user_attrs)
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

    def seed_arm(self, number: int) -> Arm | None:
        """Trial ``number``'s own rounds as an arm (``trial<number>``); None before a round past step 0."""
        baseline, rounds = self._baselines.get(number), self._rounds.get(number)
        if baseline is None or not rounds:
            return None
        return Arm(f"trial{number}", baseline, tuple(rounds))

    def _draws_for(self, arm: Arm) -> FloatArray:
        if self._draws is None:
            self._draws = prompt_draws(arm.baseline.correct.size, self.settings)
        return self._draws

    def _seed_fit(self, number: int, arm: Arm) -> ArmFit:
        cached = self._seed_fits.get(number)
        if cached is not None and cached[0] == len(arm.rounds):
            return cached[1]
        fitted = fit_arm(arm, self.settings, self._draws_for(arm))
        self._seed_fits[number] = (len(arm.rounds), fitted)
        return fitted

    def _fit(self, name: str, numbers: list[int]) -> ArmFit | None:
        """The arm ``name`` of trials ``numbers``, pooled and fitted (cached until a trial gains a round)."""
        seeds = {n: a for n in sorted(numbers) if (a := self.seed_arm(n)) is not None}
        if not seeds:
            return None
        key = tuple((n, len(a.rounds)) for n, a in seeds.items())
        cached = self._fits.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        if len(seeds) == 1:
            (arm,) = seeds.values()
            fitted = fit_arm(Arm(name, arm.baseline, arm.rounds), self.settings, self._draws_for(arm))
        else:
            # The spread of A over the seeds whose own fits are determined: replicates of the recipe.
            own = [self._seed_fit(n, a) for n, a in seeds.items()]
            spread = seed_spread([f.fit.a for f in own if f.fit is not None and f.comparable])
            pooled = pool(name, list(seeds.values()), spread)
            fitted = fit_arm(pooled, self.settings, self._draws_for(pooled), list(seeds.values()))
        self._fits[name] = (key, fitted)
        return fitted

    def fit_arms(self, study: Study) -> dict[str, ArmFit]:
        """Every arm of ``study`` fitted on all its trials' rounds, pruned trials too (an audit or a report
        reads the whole curves)."""
        groups = self._groups(study, states=None)
        return {name: f for name, nums in groups.items() if (f := self._fit(name, nums)) is not None}

    def _groups(
        self, study: Study, states: tuple[optuna.trial.TrialState, ...] | None = _JUDGED_STATES
    ) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for other in study.get_trials(deepcopy=False, states=states):
            groups.setdefault(self.arm_name(other.number, other.user_attrs), []).append(other.number)
        return groups

    def prune(self, study: Study, trial: FrozenTrial) -> bool:
        """Judge ``trial``'s arm at the first planned look its furthest trial has passed and the arm has not
        been judged at."""
        name = self.arm_name(trial.number, trial.user_attrs)
        groups = self._groups(study)
        numbers = groups.setdefault(name, [])
        if trial.number not in numbers:
            numbers.append(trial.number)
        arm = self._fit(name, numbers)
        if arm is None:
            return False
        due = sum(look <= self.progress(numbers) * (1 + 1e-9) for look in self.settings.looks)
        if due <= self._looks_judged.get(name, 0):
            return False
        self._looks_judged[name] = due
        fits = [f for n, nums in groups.items() if (f := arm if n == name else self._fit(n, nums)) is not None]
        verdict = judge(fits, self.settings, self.num_arms)[name]
        self._verdicts[name] = verdict
        return verdict.stop

    def progress(self, numbers: list[int]) -> float:
        """The progress of the arm of trials ``numbers``: their compute summed over the seeds it plans."""
        return sum(a.compute for n in numbers if (a := self.seed_arm(n)) is not None) / self.seeds

    def looks_judged(self, arm: str) -> int:
        """How many planned looks arm ``arm`` has been judged at."""
        return self._looks_judged.get(arm, 0)

    def verdicts(self) -> dict[str, Verdict]:
        """Every arm's outcome at its latest look, by arm."""
        return dict(self._verdicts)

    def verdict(self, number: int) -> Verdict | None:
        """The outcome of trial ``number``'s arm at its latest look; None before its first."""
        name = self._names.get(number)
        return None if name is None else self._verdicts.get(name)

    def _arm_fit(self, number: int) -> ArmFit | None:
        name = self._names.get(number)
        cached = self._fits.get(name) if name is not None else None
        if cached is not None:
            return cached[1]
        arm = self.seed_arm(number)
        return None if arm is None else self._seed_fit(number, arm)

    def objective_value(self, number: int) -> float:
        """The value a trial's objective returns: its arm's fitted A, else its last pass rate (a trial too
        young to fit)."""
        fitted = self._arm_fit(number)
        if fitted is not None and fitted.fit is not None:
            return fitted.fit.a
        arm = self.seed_arm(number)
        if arm is None:
            raise ValueError(f"trial {number} has recorded no eval round after its step-0 round")
        return arm.rounds[-1].pass_rate

    def user_attrs(self, number: int) -> dict[str, float | str | bool | None]:
        """What the study keeps beside the objective: the arm's outcome and its reason, A with its interval,
        B and C_mid, and whether the fit is determined (JSON values, for ``Trial.set_user_attr``)."""
        verdict = self.verdict(number)
        fitted = self._arm_fit(number)
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
