"""Multi-turn groups in the learner: each sequence on its own prompt, each episode one reward and advantage.

A group of a multi-turn task holds its episodes' sequences: an episode the
chat template re-rendered goes on in a sequence with a prompt of its own
and ``continues_episode`` set. The batch is laid out and stepped by
``collate`` and ``Trainer.step``, and checked against a slow reference
that walks episodes and sequences one at a time in float64: advantages
centred over each group's episodes (not its sequences), normalised by the
batch's std over episodes, every sequence scored from its own unpadded
prompt, the environment's tokens (mask 0) out of the loss.
"""

from __future__ import annotations

import copy
import math

import pytest
from transformers import LlamaForCausalLM

from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import PayloadError
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.trainer import Trainer, collate
from tests.learner.test_trainer import PAD, completion, group, reference_logprobs, tiny_llama  # noqa: F401

EPS_MAX = 4.0
"""LossSettings' default CISPO cap."""


def sequence(
    token_ids: list[int],
    logprobs: list[float],
    spans: list[tuple[int, int, int]],
    reward: float,
    mask: list[int] | None = None,
    prompt: list[int] | None = None,
    continues: bool = False,
) -> rollout_pb2.Completion:
    c = completion(token_ids, logprobs, spans, reward, loss_mask=mask or ())
    if prompt is not None:
        c.prompt_token_ids.extend(prompt)
    c.continues_episode = continues
    return c


def multiturn_groups() -> list[rollout_pb2.RolloutGroup]:
    """Two groups of two episodes each. In g0, episode 1 was re-rendered: its second sequence has a longer
    prompt of its own (the whole conversation so far, rendered anew) and shares the episode's reward.
    Environment tokens sit between model turns with mask 0, log-prob 0 and no version span."""
    g0 = group(
        "g0",
        prompt=[1, 5, 6],
        completions=[
            # turn (7, 8), environment (3, 4), turn (9, 2)
            sequence([7, 8, 3, 4, 9, 2], [-0.5, -1.25, 0, 0, -0.75, -2.0], [(3, 0, 2), (4, 4, 6)], 1.0,
                     mask=[1, 1, 0, 0, 1, 1]),
            sequence([10, 11], [-0.25, -3.0], [(4, 0, 2)], 0.0),
            sequence([12, 13, 2], [-1.0, -0.5, -0.125], [(5, 0, 3)], 0.0, prompt=[1, 5, 6, 10, 3, 4, 14], continues=True),
        ],
    )  # fmt: skip
    g1 = group(
        "g1",
        prompt=[1, 9],
        completions=[
            sequence([4, 4, 15], [-2.0, -0.0625, -1.5], [(5, 0, 3)], 0.25),
            sequence([6, 3, 7], [-0.375, 0, -1.0], [(5, 0, 1), (6, 2, 3)], 1.0, mask=[1, 0, 1]),
        ],
    )
    return [g0, g1]


def test_collate_gives_each_sequence_its_prompt_and_its_episode() -> None:
    inputs = collate(multiturn_groups(), pad_id=PAD)
    b = inputs.batch
    assert b.prompt_len == 7
    rows = [
        [m for m, a in zip(ids, att) if a]
        for ids, att in zip(b.input_ids.tolist(), b.attention_mask.tolist(), strict=True)
    ]
    assert rows == [
        [1, 5, 6, 7, 8, 3, 4, 9, 2],
        [1, 5, 6, 10, 11],
        [1, 5, 6, 10, 3, 4, 14, 12, 13, 2],
        [1, 9, 4, 4, 15],
        [1, 9, 6, 3, 7],
    ]
    # One reward per episode; each row points at its episode's.
    assert inputs.rewards.tolist() == [[1.0, 0.0], [0.25, 1.0]]
    assert inputs.reward_index.tolist() == [0, 1, 1, 2, 3]
    assert inputs.prompt_index.tolist() == [0, 0, 0, 1, 1]
    assert inputs.loss_mask.tolist() == [
        [1, 1, 0, 0, 1, 1],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
    ]
    assert inputs.token_versions.tolist() == [
        [3, 3, 0, 0, 4, 4],
        [4, 4, 0, 0, 0, 0],
        [5, 5, 5, 0, 0, 0],
        [5, 5, 5, 0, 0, 0],
        [5, 0, 6, 0, 0, 0],
    ]


def reference_loss(model: LlamaForCausalLM, groups: list[rollout_pb2.RolloutGroup], aggregation: str) -> float:
    """CISPO over episodes and sequences, one token at a time in float64 (every group here has variance)."""
    centred: list[list[float]] = []  # group -> sequence -> advantage before the batch std
    values: list[float] = []  # one centred reward per episode
    for g in groups:
        episode_rewards = [c.reward for c in g.completions if not c.continues_episode]
        mean = sum(episode_rewards) / len(episode_rewards)
        values += [r - mean for r in episode_rewards]
        centred.append([c.reward - mean for c in g.completions])
    std = math.sqrt(sum(v * v for v in values) / len(values))  # the centred values have mean 0
    per_prompt: list[list[list[float]]] = []
    for g, row in zip(groups, centred, strict=True):
        sequences = []
        for c, a in zip(g.completions, row, strict=True):
            prompt = list(c.prompt_token_ids) or list(g.prompt_token_ids)
            logp, _ = reference_logprobs(model, prompt, list(c.token_ids), 1.0)
            mask = list(c.loss_mask) or [1] * len(c.token_ids)
            terms = []
            for t, lp in enumerate(logp.double().tolist()):
                if mask[t]:
                    terms.append(-min(math.exp(lp - c.logprobs[t]), EPS_MAX) * (a / std) * lp)
            sequences.append(terms)
        per_prompt.append(sequences)
    if aggregation == "prompt":
        means = [sum(sum(s) for s in p) / sum(len(s) for s in p) for p in per_prompt]
        return sum(means) / len(means)
    if aggregation == "sample":
        means = [sum(s) / len(s) for p in per_prompt for s in p]
        return sum(means) / len(means)
    tokens = [x for p in per_prompt for s in p for x in s]
    return sum(tokens) / len(tokens)


@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_step_loss_over_episodes_matches_reference(tiny_llama: LlamaForCausalLM, aggregation: str) -> None:  # noqa: F811
    groups = multiturn_groups()
    want = reference_loss(tiny_llama, groups, aggregation)
    trainer = Trainer(copy.deepcopy(tiny_llama), LossSettings(aggregation=aggregation), OptimizerSettings())  # type: ignore[arg-type]
    got = trainer.step(collate(groups, PAD), learner_version=6)
    assert got["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert got["batch/loss_samples"] == 5.0
    assert got["batch/loss_tokens"] == 4 + 2 + 3 + 3 + 2
    # Episodes, not sequences, are the batch's samples.
    assert got["batch/samples"] == 4.0


def test_groups_of_different_episode_counts_are_refused() -> None:
    """Three sequences each, but two episodes against three: the advantages would not line up."""
    g0, g1 = multiturn_groups()
    g1.completions.append(copy.deepcopy(g1.completions[1]))
    with pytest.raises(PayloadError, match="g1 has 3 episodes, the batch has 2"):
        collate([g0, g1], PAD)
