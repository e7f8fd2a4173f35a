"""What a generator's task counts FLOPs from: the tokens it ran through the model once each."""

from __future__ import annotations

from asymptote.compute import ComputeMeter
from asymptote.sample import Sample
from services.generator.episode import Episode, TrainingSample
from services.generator.rollout import processed_tokens


def _sample(n: int) -> Sample:
    return Sample(list(range(n)), [0.0] * n, [(0, 0, n)], "stop", "x" * n, num_cached_tokens=5)


def test_a_group_counts_its_prompt_once_and_every_sampled_token() -> None:
    """G samples share the prompt's prefill; cache hits are not subtracted (they depend on the engine's state)."""
    assert processed_tokens(list(range(12)), [_sample(30), _sample(20), _sample(25)], []) == 12 + 75


def test_an_episode_counts_each_training_sample_with_its_prompt_and_its_environment_tokens() -> None:
    episodes = [
        Episode([TrainingSample(list(range(10)), _sample(40))], "done", 1.0, 2, "a", num_env_tokens=8),
        Episode(
            [TrainingSample(list(range(10)), _sample(15)), TrainingSample(list(range(30)), _sample(5))],
            "done",
            0.0,
            3,
            "b",
        ),
    ]
    samples = [t.sample for e in episodes for t in e.samples]
    assert processed_tokens(None, samples, episodes) == (10 + 40) + (10 + 15) + (30 + 5)


def test_the_meter_turns_them_into_2n_flops_a_token_with_eval_apart() -> None:
    meter = ComputeMeter("generator", "g", "cpu-core", 1, num_params=1_000)
    meter.add_tokens(75, num_processed=87)
    meter.add_tokens(10, eval=True, num_processed=20)
    t = meter.snapshot()
    assert (t.flops_total, t.eval_flops_total, t.num_tokens_total) == (2_000 * 107, 2_000 * 20, 85)
