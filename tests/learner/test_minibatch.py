"""PPO-off-policy-k: k optimizer steps per generated batch, each on its mini-batch, against a reference."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from asymptote.contracts.v1 import services_pb2
from services.learner.config import LearnerConfig, LossSettings, OptimizerSettings
from services.learner.minibatch import collate_mini_batches, split_groups
from services.learner.trainer import Trainer
from tests.learner.test_trainer import PAD, reference_semantics, semantics_stream, tiny_llama  # noqa: F401


def test_split_keeps_order_and_spreads_the_remainder() -> None:
    assert split_groups(list(range(4)), 2) == [[0, 1], [2, 3]]  # type: ignore[arg-type]
    assert split_groups(list(range(5)), 2) == [[0, 1, 2], [3, 4]]  # type: ignore[arg-type]
    assert split_groups(list(range(3)), 3) == [[0], [1], [2]]  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        split_groups(list(range(2)), 3)  # type: ignore[arg-type]


@pytest.mark.parametrize("aggregation", ["prompt", "token"])
def test_two_updates_per_batch_each_on_its_half_match_the_reference(
    tiny_llama: LlamaForCausalLM,  # noqa: F811
    aggregation: str,
) -> None:
    batch = semantics_stream()[:4]
    header = services_pb2.BatchHeader(batch_id="b", num_groups=4)
    minis = collate_mini_batches(batch, PAD, header, k=2)
    assert len(minis) == 2
    trainer = Trainer(
        copy.deepcopy(tiny_llama),
        LossSettings(aggregation=aggregation),  # type: ignore[arg-type]
        OptimizerSettings(lr=1e-2, warmup_steps=0),
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    for i, (inputs, half) in enumerate(zip(minis, (batch[:2], batch[2:]))):
        assert inputs.num_prompts == 2 and inputs.num_taken == 2
        # The reference reads the weights this step starts from: the first step's moved them.
        want = reference_semantics(trainer.model, half, "drop", 2, aggregation)
        got = trainer.step(inputs, learner_version=5 + i)
        assert got["batch/prompts"] == want["batch/prompts"] == 2.0
        assert got["batch/loss_tokens"] == want["batch/loss_tokens"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {2}  # exactly two optimizer steps for the one batch
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_refill_drops_count_as_taken_by_the_first_mini_batch() -> None:
    batch = semantics_stream()[:4]
    header = services_pb2.BatchHeader(batch_id="b", num_groups=4, num_zero_variance=3)
    assert [m.num_taken for m in collate_mini_batches(batch, PAD, header, k=2)] == [5, 2]


def test_config_wants_steps_in_whole_batches(tmp_path: object) -> None:
    base = {"model_dir": "/m", "batch_prompts": 4, "max_steps": 20, "checkpoint_every_steps": 10}
    assert LearnerConfig(**base, updates_per_batch=2).updates_per_batch == 2  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_steps"):
        LearnerConfig(**{**base, "max_steps": 21}, updates_per_batch=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exceeds batch_prompts"):
        LearnerConfig(**base, updates_per_batch=5)  # type: ignore[arg-type]
