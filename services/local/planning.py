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

from asymptote.errors import ConfigError
from services.learner.activations import ModelShape
from services.learner.config import LearnerConfig
from services.learner.memory import (
    DEFAULT_PROMPT_TOKENS,
    GeneratorSettings,
    check_learner,
    suggest_micro_batch_tokens,
)
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


def described_gpus(count: int, memory_gib: float, name: str = "") -> list[Gpu]:
    """``count`` GPUs of ``memory_gib`` each (cards named ``name``), numbered from 0: a machine planned for,
    not this one."""
    return [Gpu(str(i), int(memory_gib * GIB), name) for i in range(count)]


def placement_of(config: StackConfig, gpus: list[Gpu]) -> Placement:
    """How ``config`` splits ``gpus`` (its ``gpus`` of them): the stack's own rule.

    With neither ``num_generators`` nor ``learner_gpus`` set, a model directory to plan by and a card the
    step-time estimate knows, the split is ``balanced_split``'s; otherwise ``place``'s half and half.
    """
    chosen = gpus[: config.gpus] if config.gpus else gpus
    placement = place(
        chosen,
        tensor_parallel_size=config.tensor_parallel_size,
        num_generators=config.num_generators,
        learner_gpus=config.learner_gpus,
    )
    if config.num_generators is not None or config.learner_gpus is not None or config.model_dir is None:
        return placement
    return balanced_split(config, chosen, config.model_dir) or placement


def balanced_split(config: StackConfig, gpus: list[Gpu], model_dir: Path) -> Placement | None:
    """The split of ``gpus`` with the shortest step by ``asymptote plan``'s estimate (services/ops/cost.py:
    generating and training overlap, the slower sets the pace), among those whose learner ranks fit; None
    when the estimate does not apply (fewer than three GPUs, a card it has no figures for).

    A generator takes ``tensor_parallel_size`` GPUs, so the candidates are the multiples of it. The
    estimate reads the up config's batch (``batch_prompts`` x ``group_size`` completions of half
    ``max_tokens`` on average) and the model's shape; the placement says it was chosen so.
    """
    from services.learner.memory import plan_generator
    from services.ops.cost import ACCELERATORS, accelerator_key, step_cost

    tp = config.tensor_parallel_size
    key = accelerator_key(gpus[0].name) if len(gpus) >= 3 else None
    if key is None:
        return None
    shape = ModelShape.read(model_dir)
    costs = []
    for generators in range(1, len(gpus) // tp + 1):
        learner_gpus = len(gpus) - generators * tp
        if learner_gpus < 1:
            break
        placement = place(gpus, tensor_parallel_size=tp, num_generators=generators, learner_gpus=learner_gpus)
        try:
            learner = planned_learner(config, model_dir, placement)
        except ConfigError:
            continue  # the learner's ranks do not fit on so few GPUs
        generator = plan_generator(
            shape,
            planned_engine(config, placement),
            gpu_memory_gib=min(g.memory_bytes for g in gpus) / GIB,
            sequence_tokens=DEFAULT_PROMPT_TOKENS + config.max_tokens,
        )
        cost = step_cost(
            shape,
            generator,
            accelerator=ACCELERATORS[key],
            generator_gpus=generators * tp,
            learner_gpus=learner_gpus,
            batch_prompts=config.batch_prompts,
            group_size=config.group_size,
            prompt_tokens=DEFAULT_PROMPT_TOKENS,
            mean_completion_tokens=planned_completion_tokens(config),
            activation_checkpointing=learner.activation_checkpointing,
        )
        costs.append((cost.step_s, -learner_gpus, placement, cost))
    if not costs:
        return None
    _, _, placement, cost = min(costs, key=lambda c: (c[0], c[1]))
    why = (
        f"split by the plan's estimate on {ACCELERATORS[key].name}: {cost.generate_s:,.1f} s generating and "
        f"{cost.train_s:,.1f} s training a step; num_generators or learner_gpus sets it"
    )
    return Placement(generators=placement.generators, learner=placement.learner, why=why)


def planned_engine(config: StackConfig, placement: Placement) -> GeneratorSettings:
    """A generator's engine as the memory plan sizes it on ``placement``: bf16, the placement's share of its
    GPUs, ``tensor_parallel_size`` of them."""
    return GeneratorSettings(
        dtype="bfloat16",
        gpu_memory_utilization=placement.generator_fraction,
        tensor_parallel_size=config.tensor_parallel_size,
    )


def planned_completion_tokens(config: StackConfig) -> int:
    """The mean completion the step-time estimate assumes: half ``max_tokens``."""
    return max(1, config.max_tokens // 2)


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
