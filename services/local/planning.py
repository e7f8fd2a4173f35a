"""What ``asymptote up`` will run on GPUs, decided before anything starts.

Owns the learner's settings on its placement (bf16 FSDP2 over its ranks,
activation checkpointing, and the largest round ``micro_batch_tokens`` the
memory planner fits in the GPU share it has), and the placement of a run on
GPUs that are described rather than found: the cards ``asymptote plan
--gpus N`` and ``asymptote up --dry-run`` plan for on a machine that has
none. The stack itself calls the same function, so what the plan prints is
what the run starts with. Pure arithmetic: nothing heavy is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.learner.activations import ModelShape
from services.learner.config import LearnerConfig
from services.learner.memory import DEFAULT_PROMPT_TOKENS, check_learner, suggest_micro_batch_tokens
from services.local.config import StackConfig
from services.local.placement import Gpu, Placement, place

GIB = 2**30


def learner_on_gpus(learner: LearnerConfig, model_dir: Path, placement: Placement, max_tokens: int) -> LearnerConfig:
    """The learner on its GPUs: bf16, FSDP2 over its ranks, activation checkpointing, and the largest round
    ``micro_batch_tokens`` the memory planner fits (of the GPU's share the engine leaves when they share
    one); ConfigError naming what to change when not one sequence fits."""
    gpu = placement.gpu_memory_bytes * (1 - placement.generator_fraction if placement.shared else 1)
    on_gpus = learner.model_copy(
        update={
            "device": "cuda",
            "activation_checkpointing": True,
            "device_kind": "gpu",
            "num_devices": len(placement.learner),
        }
    )
    shape = ModelShape.read(model_dir)
    where: dict[str, Any] = {
        "gpus_per_node": len(placement.learner),
        "gpu_memory_gib": gpu / GIB,
        "sequence_tokens": DEFAULT_PROMPT_TOKENS + max_tokens,
    }
    tokens = suggest_micro_batch_tokens(shape, on_gpus, **where)
    fitted = on_gpus.model_copy(update={"micro_batch_tokens": tokens or where["sequence_tokens"]})
    check_learner(shape, fitted, **where)  # the planner's own refusal when not one sequence fits
    return fitted


def described_gpus(count: int, memory_gib: float) -> list[Gpu]:
    """``count`` GPUs of ``memory_gib`` each, numbered from 0: a machine planned for, not this one."""
    return [Gpu(str(i), int(memory_gib * GIB)) for i in range(count)]


def placement_of(config: StackConfig, gpus: list[Gpu]) -> Placement:
    """How ``config`` splits ``gpus`` (its ``gpus`` of them): the stack's own rule."""
    return place(
        gpus[: config.gpus] if config.gpus else gpus,
        tensor_parallel_size=config.tensor_parallel_size,
        num_generators=config.num_generators,
        learner_gpus=config.learner_gpus,
    )


def planned_learner(config: StackConfig, model_dir: Path, placement: Placement) -> LearnerConfig:
    """The learner's config as the stack writes it, less its wiring (the plan needs only what memory depends
    on): the stack's dials, the placement's settings (``learner_on_gpus``), then its ``services.learner``
    section over them, in the stack's order."""
    from asymptote.config import merge
    from services.learner.config import OptimizerSettings

    base = LearnerConfig(
        model_dir=model_dir,
        optimizer=OptimizerSettings(lr=config.lr, warmup_steps=config.warmup_steps),
        batch_prompts=config.batch_prompts,
        updates_per_batch=config.updates_per_batch,
        max_steps=config.max_steps,
        checkpoint_every_steps=config.checkpoint_every_steps,
    )
    placed = learner_on_gpus(base, model_dir, placement, config.max_tokens)
    return LearnerConfig.model_validate(merge(placed.model_dump(), config.services.learner))
