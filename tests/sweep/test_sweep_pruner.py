"""The sweep rule as an Optuna pruner, used from a real Optuna study through ask-and-tell (in-memory storage)."""

from __future__ import annotations

import numpy as np
import optuna

from benchmarks.sweep import simulate_arms
from services.fitter.curve import CurveFitSettings
from services.sweep.pruner import AsymptotePruner
from services.sweep.rule import SweepSettings

ROUNDS = np.arange(1, 51) / 50.0
SETTINGS = SweepSettings(
    warmup_compute=0.1, budget_compute=1.0, num_resamples=50, curve=CurveFitSettings(num_bootstrap_resamples=50)
)


def test_the_pruner_prunes_the_dominated_trial_and_not_the_others() -> None:
    """Three trials stepping together round by round: two of one recipe (A 0.68) and one far below it
    (A 0.48, both past their bend by the 40% look). The low one is pruned at a look, as dominated; the
    others complete with their fitted A as the objective and the outcome in their user attributes."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    arms = simulate_arms([0.68, 0.68, 0.48], [2.0, 2.0, 2.0], [0.15, 0.15, 0.15], np.random.default_rng(2), ROUNDS)
    pruner = AsymptotePruner(SETTINGS, num_arms=3, compute_per_step=0.01)
    study = optuna.create_study(direction="maximize", pruner=pruner, storage=optuna.storages.InMemoryStorage())
    handles = {}
    trials = {}
    for arm in arms:
        trial = study.ask()
        handles[trial.number], trials[trial.number] = trial, arm
        pruner.record(trial, arm.baseline)
    pruned_at: dict[int, float] = {}
    for j, compute in enumerate(ROUNDS):
        for number, arm in trials.items():
            if number in pruned_at:
                continue
            trial = handles[number]
            pruner.record(trial, arm.rounds[j])
            if trial.should_prune():
                for key, value in pruner.user_attrs(number).items():
                    trial.set_user_attr(key, value)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                pruned_at[number] = float(compute)
    for number, trial in handles.items():
        if number not in pruned_at:
            for key, value in pruner.user_attrs(number).items():
                trial.set_user_attr(key, value)
            study.tell(trial, pruner.objective_value(number))
    # Pruned at a look: the first round at or past a look's compute (rounds every 2%).
    assert list(pruned_at) == [2] and any(0 <= pruned_at[2] - look < 0.02 for look in SETTINGS.looks)
    done = {t.number: t for t in study.get_trials()}
    assert done[2].state == optuna.trial.TrialState.PRUNED
    assert done[2].user_attrs["sweep_outcome"] == "dominated"
    # Reported at integer steps of the compute axis: one per round, 1% of the budget each.
    assert sorted(done[2].intermediate_values)[:3] == [2, 4, 6]
    for number in (0, 1):
        assert done[number].state == optuna.trial.TrialState.COMPLETE
        assert done[number].user_attrs["sweep_outcome"] in ("leader", "undecided", "equivalent")
        assert done[number].user_attrs["determined"] is True
        value = done[number].value
        assert value is not None and abs(value - 0.68) < 0.06
        assert done[number].user_attrs["a_low"] < value < done[number].user_attrs["a_high"]


def test_trials_sharing_an_arm_are_pooled_and_judged_as_one_arm() -> None:
    """Two recipes x two seeds, the trials of a recipe sharing the ``arm`` attribute. The pruner judges arms:
    both seeds of the low recipe are pruned at the same look, by one verdict naming the arm; the seed term of
    the error rate is split over arms; and the surviving arm's objective is the pooled fit's A, the same for both of its trials."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rng = np.random.default_rng(5)
    arms = simulate_arms([0.68, 0.67, 0.48, 0.49], [2.0] * 4, [0.15] * 4, rng, ROUNDS)
    pruner = AsymptotePruner(SETTINGS, num_arms=2, compute_per_step=0.01)
    study = optuna.create_study(direction="maximize", pruner=pruner, storage=optuna.storages.InMemoryStorage())
    handles = {}
    for i, arm in enumerate(arms):
        trial = study.ask()
        trial.set_user_attr("arm", "good" if i < 2 else "low")
        handles[trial.number] = (trial, arm)
        pruner.record(trial, arm.baseline)
    pruned: dict[int, float] = {}
    for j, compute in enumerate(ROUNDS):
        for number, (trial, arm) in handles.items():
            if number in pruned:
                continue
            pruner.record(trial, arm.rounds[j])
            if trial.should_prune() or (number in (2, 3) and any(n in pruned for n in (2, 3))):
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                pruned[number] = float(compute)
    assert sorted(pruned) == [2, 3] and pruned[2] == pruned[3]
    verdict = pruner.verdict(2)
    assert verdict is not None and verdict is pruner.verdict(3)
    assert verdict.outcome == "dominated" and verdict.leader == "good"
    # The error rate is split over the 2 arms, not the 4 trials: 0.05 / (1 x 7 looks), two-sided.
    assert len(SETTINGS.looks) == 7 and "at 98.6%" in verdict.reason
    assert pruner.looks_judged("low") >= 1 and pruner.looks_judged("trial2") == 0
    good = {pruner.objective_value(n) for n in (0, 1)}
    assert len(good) == 1 and abs(good.pop() - 0.675) < 0.05
