"""RL learns: a seeded short run through the learner's own step raises the held-out pass rate.

The loop is the pipeline's with the transport taken out. Each step samples G
completions for each of B train prompts from the current policy, scores them
with the task's verifier, packs them into the ``RolloutGroup`` messages a
generator publishes (``services.generator.rollout.completion``), and trains
on them with the learner's ``collate`` and ``Trainer`` under the service's
default loss and optimizer settings (CISPO, prompt-level aggregation, batch
advantage normalisation, AdamW). Sampling uses the transformers model
(``services.learner.model.sample``): vLLM cannot share a process with the
learner's torch (ENVIRONMENT.md), and the end-to-end tests run the real
generators. The run is on-policy; staleness has tests of its own.

Nothing here depends on luck: the prompts, the sampling and the evaluation
are seeded, and torch runs single-threaded, so a run repeats bit for bit on a
given build. The margin comes from measured runs (100 steps of 32 prompts x
8 completions from the cached warm-started model): over seeds 0-7 the
held-out pass rate rose by 0.105 to 0.218 (seed 0: 0.341 -> 0.510); with the
learning rate at 0 (seeds 0-3) it moved by -0.008 to +0.033, which is the
evaluation's own sampling noise; with the advantage's sign flipped (seeds
0-2) it fell to 0.
``MIN_GAIN`` sits between them, so the check passes when the learner learns
and fails when it does not, and the twins below show both sabotaged runs
failing the same check.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from asymptote.contracts.v1 import rollout_pb2
from asymptote.sample import Sample
from asymptote.tasks import ArithmeticSettings, get_task
from services.embedded.warmstart import encode_prompts, evaluate_pass_rate, max_new_tokens_for, prepare_model
from services.generator.rollout import completion
from services.learner import trainer as trainer_module
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.model import load_model, load_tokenizer, sample
from services.learner.trainer import Trainer, collate

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SEED = 0
NUM_STEPS = 100
NUM_PROMPTS = 32
GROUP_SIZE = 8
EVAL_SAMPLES = 4
MIN_GAIN = 0.06
"""Held-out pass-rate rise the run must reach: below the smallest rise measured
(0.105), about twice the largest drift with a zero learning rate (0.033)."""


@dataclass(frozen=True)
class RunResult:
    pass_rate_before: float
    pass_rate_after: float

    @property
    def gain(self) -> float:
        return self.pass_rate_after - self.pass_rate_before


def assert_learns(result: RunResult) -> None:
    """The check every run here is held to."""
    assert result.gain >= MIN_GAIN, (
        f"held-out pass rate {result.pass_rate_before:.3f} -> {result.pass_rate_after:.3f} "
        f"(+{result.gain:.3f}), below the required +{MIN_GAIN}"
    )


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The embedded default's warm-started model (cached in the checkout, shared with the e2e tests)."""
    return prepare_model(REPO / ".cache" / "asymptote")


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rl_run(model_dir: Path, optimizer: OptimizerSettings, seed: int = SEED, num_steps: int = NUM_STEPS) -> RunResult:
    """Train the model in ``model_dir`` for ``num_steps`` learner steps; the held-out pass rate before and after."""
    torch.manual_seed(seed)
    task_settings = ArithmeticSettings()
    task = get_task(task_settings.name, task_settings)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir)
    problems = list(task.problems("train"))
    prompt_ids = encode_prompts(tokenizer, problems)
    max_new = max_new_tokens_for(tokenizer, problems)
    trainer = Trainer(model, LossSettings(), optimizer)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []

    def held_out(step: int) -> float:
        model.eval()
        return evaluate_pass_rate(model, tokenizer, task, EVAL_SAMPLES, seed=seed + 7919 * (step + 1)).pass_rate

    before = held_out(0)
    for version in range(num_steps):
        if len(order) < NUM_PROMPTS:
            fresh = list(range(len(problems)))
            rng.shuffle(fresh)
            order.extend(fresh)
        idx, order = order[:NUM_PROMPTS], order[NUM_PROMPTS:]
        model.eval()
        rows = [prompt_ids[i] for i in idx for _ in range(GROUP_SIZE)]
        samples = sample(
            model, rows, max_new, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, generator=gen
        )
        texts = tokenizer.batch_decode(samples.completions, skip_special_tokens=True)
        groups = []
        for p, i in enumerate(idx):
            completions = []
            for r in range(p * GROUP_SIZE, (p + 1) * GROUP_SIZE):
                tokens = samples.completions[r]
                text = texts[r]
                generated = Sample(
                    token_ids=tokens,
                    logprobs=samples.logprobs[r],
                    version_spans=[(version, 0, len(tokens))],
                    finish_reason="length" if samples.truncated[r] else "stop",
                    text=text,
                )
                completions.append(completion(generated, task.score(text, problems[i].reference)))
            groups.append(
                rollout_pb2.RolloutGroup(
                    group_id=f"g{version}-{p}",
                    task=rollout_pb2.GenerationTask(
                        task_id=f"t{version}-{p}",
                        sampling=rollout_pb2.SamplingParams(temperature=1.0, num_samples=GROUP_SIZE),
                    ),
                    prompt_token_ids=prompt_ids[i],
                    completions=completions,
                )
            )
        trainer.step(collate(groups, tokenizer.pad_token_id), learner_version=version + 1)
    return RunResult(before, held_out(num_steps))


def test_rl_raises_the_held_out_pass_rate(model_dir: Path, one_thread: None) -> None:
    result = rl_run(model_dir, OptimizerSettings())
    print(f"held-out pass rate {result.pass_rate_before:.3f} -> {result.pass_rate_after:.3f} (+{result.gain:.3f})")
    assert_learns(result)


def test_the_learning_check_fails_with_the_advantage_sign_flipped(
    model_dir: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training toward the wrong answers must not pass: the same run and check, advantages negated."""
    real = trainer_module.group_advantages

    def flipped(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        advantages, keep = real(*args, **kwargs)
        return -advantages, keep

    monkeypatch.setattr(trainer_module, "group_advantages", flipped)
    result = rl_run(model_dir, OptimizerSettings())
    with pytest.raises(AssertionError, match="below the required"):
        assert_learns(result)
    assert result.gain < 0, "reinforcing the failures should lower the pass rate"


def test_the_learning_check_fails_with_a_zero_learning_rate(model_dir: Path, one_thread: None) -> None:
    """A learner whose updates do nothing must not pass: the same run and check at lr 0.

    ``model_copy`` skips validation, which refuses lr 0 from a config file.
    """
    result = rl_run(model_dir, OptimizerSettings().model_copy(update={"lr": 0.0}))
    with pytest.raises(AssertionError, match="below the required"):
        assert_learns(result)
