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
