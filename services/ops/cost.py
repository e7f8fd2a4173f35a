"""What a run's steps cost in GPU time, and how to split the GPUs between generating and training.

Owns the throughput estimate ``asymptote plan`` prints: generation as
memory-bandwidth-bound decoding (each decode step reads a GPU's share of the
weights once and every sequence's KV cache), training as FLOPs at a stated
model FLOPs utilisation (6 per parameter per token, 8 with activation
checkpointing, plus attention over the context). Both rates are estimates at
stated efficiencies, never measurements: ``benchmarks.gpu`` measures them on
a GPU, and a run's own progress line shows its real tokens/s.

A step (PipelineRL) generates ``batch_prompts x group_size`` completions
while the learner trains on the previous batch, so a step takes the longer
of the two; the split that balances them is the one where neither waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.learner.activations import ModelShape
from services.learner.memory import GeneratorPlan


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes_per_s: float
    """Peak HBM bandwidth."""
    bf16_flops: float
    """Dense bf16 peak, no sparsity."""
    memory_gib: float
    """Memory of one card as the driver reports it (nvidia-smi's total)."""


ACCELERATORS = {
    "h100": Accelerator("H100 SXM", 3.35e12, 989e12, 80.0),
    "h200": Accelerator("H200 SXM", 4.8e12, 989e12, 140.4),
    "a100": Accelerator("A100 80GB SXM", 2.04e12, 312e12, 80.0),
    "l40s": Accelerator("L40S", 0.864e12, 362e12, 45.0),
}
"""Vendor datasheet peaks, and each card's memory (H200: 143,771 MiB; L40S: 46,068 MiB)."""


def accelerator_key(card_name: str) -> str | None:
    """The ``ACCELERATORS`` key of a card by its product name ("NVIDIA H100 80GB HBM3": "h100"); None for a
    card with no estimate here."""
    name = card_name.upper()
    return next((key for key in ACCELERATORS if key.upper() in name), None)


DECODE_BANDWIDTH_EFFICIENCY = 0.5
"""Share of peak bandwidth a decode step achieves (kernels, scheduling, sampling and swaps between)."""
TRAIN_MFU = 0.35
"""Model FLOPs utilisation of a training step (FSDP2, bf16, packed micro-batches)."""


@dataclass(frozen=True)
class StepCost:
    """One RL step at a GPU split, and 100 of them."""

    accelerator: Accelerator
    generator_gpus: int
    learner_gpus: int
    completion_tokens: int
    """Tokens generated per step: batch_prompts x group_size x the mean completion."""
    trained_tokens: int
    """Tokens trained per step: the completions and their prompts."""
    generate_tokens_per_s_per_gpu: float
    train_tokens_per_s_per_gpu: float
    concurrent_sequences_per_gpu: int

    @property
    def generate_s(self) -> float:
        return self.completion_tokens / (self.generator_gpus * self.generate_tokens_per_s_per_gpu)

    @property
    def train_s(self) -> float:
        return self.trained_tokens / (self.learner_gpus * self.train_tokens_per_s_per_gpu)

    @property
    def step_s(self) -> float:
        """Generation and training overlap (PipelineRL): the slower of the two sets the pace."""
        return max(self.generate_s, self.train_s)

    @property
    def gpu_hours_per_100_steps(self) -> float:
        return 100 * self.step_s * (self.generator_gpus + self.learner_gpus) / 3600

    @property
    def balanced_generator_gpus(self) -> int:
        """Of the same GPUs in all, the generator count (at least one a side) with the shortest step."""
        total = self.generator_gpus + self.learner_gpus
        gen_work = self.completion_tokens / self.generate_tokens_per_s_per_gpu
        train_work = self.trained_tokens / self.train_tokens_per_s_per_gpu
        return min(range(1, total), key=lambda g: max(gen_work / g, train_work / (total - g)), default=total)


def decode_tokens_per_s(generator: GeneratorPlan, context_tokens: int, accelerator: Accelerator) -> tuple[float, int]:
    """Tokens/s of one generator GPU decoding as many sequences of ``context_tokens`` as its KV cache and
    max_num_seqs allow, and that many sequences: each step reads the weights once and every KV cache."""
    by_memory = max(generator.kv_tokens, 0) // max(context_tokens, 1)
    sequences = max(1, min(by_memory, generator.max_num_seqs))
    step_bytes = generator.weights_bytes + sequences * context_tokens * generator.kv_bytes_per_token
    return sequences * accelerator.memory_bytes_per_s * DECODE_BANDWIDTH_EFFICIENCY / step_bytes, sequences


def train_flops_per_token(shape: ModelShape, context_tokens: int, activation_checkpointing: bool) -> float:
    """Forward and backward FLOPs a trained token costs: 6N (8N when the forward runs again for the
    backward) plus attention's scores and values over the context, counted the same way."""
    passes = 4 if activation_checkpointing else 3
    attention = 2 * shape.num_layers * shape.num_heads * shape.head_dim * context_tokens
    return passes * (2 * shape.num_parameters + attention)


def step_cost(
    shape: ModelShape,
    generator: GeneratorPlan,
    *,
    accelerator: Accelerator,
    generator_gpus: int,
    learner_gpus: int,
    batch_prompts: int,
    group_size: int,
    prompt_tokens: int,
    mean_completion_tokens: int,
    activation_checkpointing: bool,
) -> StepCost:
    """One step's cost on ``generator_gpus`` + ``learner_gpus`` (see the module docstring)."""
    if generator_gpus < 1 or learner_gpus < 1:
        raise ValueError(f"generator_gpus {generator_gpus} and learner_gpus {learner_gpus}: at least 1 each")
    completions = batch_prompts * group_size
    # A sequence decoding is on average half-way through its completion.
    decode_context = prompt_tokens + math.ceil(mean_completion_tokens / 2)
    gen_rate, sequences = decode_tokens_per_s(generator, decode_context, accelerator)
    train_context = prompt_tokens + mean_completion_tokens
    flops = train_flops_per_token(shape, math.ceil(train_context / 2), activation_checkpointing)
    return StepCost(
        accelerator=accelerator,
        generator_gpus=generator_gpus,
        learner_gpus=learner_gpus,
        completion_tokens=completions * mean_completion_tokens,
        trained_tokens=completions * train_context,
        generate_tokens_per_s_per_gpu=gen_rate,
        train_tokens_per_s_per_gpu=accelerator.bf16_flops * TRAIN_MFU / flops,
        concurrent_sequences_per_gpu=sequences,
    )
