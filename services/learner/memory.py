"""Memory of a run before it starts: one formula for a learner rank's GPU, a generator's GPU, a learner
pod's host memory and the checkpoints on its volume.

Owns the bytes each piece of the learner holds on a GPU (float32 master
weights, gradients and AdamW moments; with a LoRA the frozen base in the
compute dtype and the adapter's float32 weights, gradients and moments, FSDP2's gathered layers and unsharded
gradients, activations and the FP32 head's logits from ``activations``,
a reserve), what a generator's GPU holds (weights and KV cache), what a
learner pod holds on the host (a load, the served versions, checkpoint
staging) and on its volume, the choice of a ``micro_batch_tokens`` that
fits, and the one-line ``ConfigError`` when a setting does not. Pure
arithmetic over ``activations.ModelShape`` and the services' settings: no
torch. Knows nothing about how the figures are printed or where settings
come from (``asymptote plan``, services/ops/plan.py, does both). The learner calls
``learner_fits`` at start, before it allocates on its GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from asymptote.errors import ConfigError
from asymptote.lora import ALL_LINEAR, LoraSettings
from services.learner.activations import DTYPE_BYTES, FLOAT32, ModelShape, activation_bytes, chunk_rows
from services.learner.config import LearnerConfig

GIB = 1 << 30

MASTER_BYTES_PER_PARAM = 4
"""float32 master weights."""
GRADIENT_BYTES_PER_PARAM = 4
"""float32 gradients (FSDP2 reduces in float32; DDP and one rank keep float32 parameters)."""
ADAMW_BYTES_PER_PARAM = 8
"""AdamW's two float32 moments."""
CHECKPOINT_BYTES_PER_PARAM = MASTER_BYTES_PER_PARAM + ADAMW_BYTES_PER_PARAM
"""A checkpoint holds float32 weights and both AdamW moments (gradients are not saved)."""
CHECKPOINT_EXTRA_BYTES = 64 << 20
"""Step counters, scheduler state and the checkpoint's metadata: small beside the tensors."""
LEARNER_RESERVE_BYTES = 3 * GIB
"""Per learner GPU, outside the tensors counted here: the CUDA context (about 0.5 GiB), NCCL's buffers
(about 1 GiB), cuBLAS workspaces and the caching allocator's fragmentation."""
GENERATOR_RESERVE_BYTES = 4 * GIB
"""Per generator GPU, beside weights and KV cache: the CUDA context, vLLM's profiled activation peak
(a prefill of max_num_batched_tokens) and its CUDA graphs."""
USABLE_FRACTION = 0.9
"""A plan fits when it needs at most this share of the GPU: the rest is margin for what the formula does
not see (transient gradients of one op, allocator rounding beyond the reserve)."""
DEFAULT_PROMPT_TOKENS = 512
"""Padded prompt length assumed when none is given (a GSM8K question in a chat template is 100-250)."""
DEFAULT_GROUP_SIZE = 16
"""Completions per prompt assumed when micro_batch_tokens is None and the broker's group size is not known."""
MIN_SUGGESTED_TOKENS = 128
"""The smallest micro-batch suggested when the sequences' length is not known."""
MAX_SUGGESTED_TOKENS = 1 << 24
"""The largest micro-batch suggested (a bound on the search, far beyond any GPU's)."""


# -- the learner's GPUs --------------------------------------------------------------------------------------


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """Each decoder linear layer of a Llama, Qwen2 or Qwen3 layer: name -> (in features, out features)."""
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_width, shape.kv_width
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def adapter_parameters(shape: ModelShape, lora: LoraSettings) -> int:
    """A LoRA's parameters: r x (in + out) for every adapted linear layer of every decoder layer; ConfigError
    naming a target module these models do not have."""
    linears = linear_shapes(shape)
    targets = list(linears) if lora.target_modules == ALL_LINEAR else list(lora.target_modules)
    unknown = [t for t in targets if t not in linears]
    if unknown:
        raise ConfigError(
            f"lora.target_modules: {shape.model_type} has no linear layer named {', '.join(unknown)}; "
            f"its decoder's are {', '.join(sorted(linears))} (or all-linear)"
        )
    return shape.num_layers * lora.rank * sum(sum(linears[t]) for t in targets)


@dataclass(frozen=True)
class Item:
    """One figure of a plan: what it is, its bytes, and how it was counted."""

    name: str
    num_bytes: int
    note: str = ""


@dataclass(frozen=True)
class LearnerPlan:
    """What one learner rank holds on its GPU, and whether that fits."""

    layout: Literal["fsdp", "ddp", "single"]
    world_size: int
    gpu_memory_bytes: int
    micro_batch_tokens: int
    """Padded tokens one forward and backward takes, as planned (at least one sequence)."""
    sequence_tokens: int
    activation_checkpointing: bool
    held: tuple[Item, ...]
    """From start to end: master weights, gradients, AdamW moments, the reserve."""
    training: tuple[Item, ...]
    """During a forward and backward."""
    stepping: tuple[Item, ...]
    """During the optimizer step and serving (not at once with a forward and backward)."""

    @property
    def total_bytes(self) -> int:
        phase = max(sum(i.num_bytes for i in self.training), sum(i.num_bytes for i in self.stepping))
        return sum(i.num_bytes for i in self.held) + phase

    @property
    def usable_bytes(self) -> int:
        return int(USABLE_FRACTION * self.gpu_memory_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    @property
    def fraction(self) -> float:
        return self.total_bytes / self.gpu_memory_bytes


def compute_bytes_of(dtype: str) -> int:
    """The learner's body on a GPU: ``auto`` is bf16 there."""
    return 2 if dtype == "auto" else DTYPE_BYTES[dtype]


def plan_learner(
    shape: ModelShape,
    config: LearnerConfig,
    *,
    gpus_per_node: int,
    nodes: int = 1,
    gpu_memory_gib: float = 80.0,
    sequence_tokens: int,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> LearnerPlan:
    """One GPU learner rank of ``nodes`` x ``gpus_per_node`` under ``config``, with sequences (prompt plus
    completion) of up to ``sequence_tokens``.

    A micro-batch is planned at its worst: ``micro_batch_tokens`` tokens
    (one whole sequence when that is more), every one of them a completion
    position (short prompts), in rows ``sequence_tokens`` wide. None plans a
    rank's whole share of the batch at once.
    """
    if gpus_per_node < 1 or nodes < 1:
        raise ConfigError(f"gpus per node ({gpus_per_node}) and nodes ({nodes}) must be at least 1")
    world = gpus_per_node * nodes
    layout: Literal["fsdp", "ddp", "single"] = "single"
    if world > 1:
        layout = "ddp" if config.parallelism == "ddp" else "fsdp"
    shards = world if layout == "fsdp" else 1
    c = compute_bytes_of(config.dtype)
    dtype = {2: "bf16" if config.dtype != "float16" else "float16", 4: "float32"}[c]
    p = shape.num_parameters
    if config.micro_batch_tokens is None:  # the rank's whole share of the batch's completions
        tokens = math.ceil(config.batch_prompts / world) * group_size * sequence_tokens
    else:
        tokens = max(config.micro_batch_tokens, sequence_tokens)
    layer, root = shape.layer_parameters, shape.root_parameters
    # The parameters with float32 masters, gradients and AdamW moments: a LoRA's adapter only.
    trained = p if config.lora is None else adapter_parameters(shape, config.lora)
    held = []
    what = "" if config.lora is None else f"LoRA rank {config.lora.rank}: {trained / 1e6:,.1f}M adapter parameters, "
    if config.lora is not None:
        base = shape.num_layers * layer * c + root * FLOAT32
        held.append(
            Item(
                "frozen base",
                base // shards,
                f"the decoder layers in {dtype}, embeddings, norm and head in float32, no gradients or AdamW"
                + _shard_note(shards),
            )
        )
    held += [
        Item(
            "weights" if config.lora is None else "adapter weights",
            MASTER_BYTES_PER_PARAM * trained // shards,
            f"{what}float32 master weights" + _shard_note(shards),
        ),
        Item("gradients", GRADIENT_BYTES_PER_PARAM * trained // shards, "float32" + _shard_note(shards)),
        Item("AdamW moments", ADAMW_BYTES_PER_PARAM * trained // shards, "two float32 moments" + _shard_note(shards)),
    ]
    if layout == "ddp":
        held.append(
            Item("DDP gradient buckets", GRADIENT_BYTES_PER_PARAM * trained, "float32, a second copy of the gradients")
        )
    held.append(Item("CUDA reserve", LEARNER_RESERVE_BYTES, "context, NCCL buffers, workspaces, fragmentation"))
    training = []
    if layout == "fsdp" and config.lora is not None:
        training.append(
            Item(
                "FSDP2 gathered weights",
                2 * layer * c + root * FLOAT32 + 2 * trained // shape.num_layers * FLOAT32,
                f"two layers in {dtype} with their adapters (one prefetched); the root in float32",
            )
        )
        training.append(
            Item(
                "FSDP2 unsharded gradients",
                trained // shape.num_layers * (c + FLOAT32),
                f"a layer's adapter's in {dtype}, and in float32 to reduce-scatter (the base has none)",
            )
        )
    elif layout == "fsdp":
        training.append(
            Item(
                "FSDP2 gathered weights",
                2 * layer * c + root * FLOAT32,
                f"two layers in {dtype} (one prefetched); the root (embeddings, head, norm) in float32",
            )
        )
        training.append(
            Item(
                "FSDP2 unsharded gradients",
                root * FLOAT32 + layer * (c + FLOAT32),
                f"the root's in float32; a layer's in {dtype}, and in float32 to reduce-scatter",
            )
        )
    elif c < FLOAT32:
        copies = shape.num_layers * layer * c if config.lora is None else trained * c
        of = "the layers' weights" if config.lora is None else "the adapter's weights (the base is held in it)"
        training.append(Item("autocast weight copies", copies, f"{of} cast to {dtype}"))
    acts = activation_bytes(
        shape,
        tokens=tokens,
        width_tokens=sequence_tokens,
        completion_positions=tokens,
        compute_bytes=c,
        attention="sdpa",
        fsdp=layout == "fsdp",
        checkpointing=config.activation_checkpointing,
    )
    per_token = acts.kept / tokens
    training.append(
        Item(
            "activations",
            acts.kept,
            f"{tokens:,} tokens x {per_token / 1024:,.1f} KiB: "
            + ("each layer's input (checkpointed)" if config.activation_checkpointing else "every layer's"),
        )
    )
    if acts.recomputed > acts.head:
        training.append(Item("recomputed layer", acts.recomputed, "one layer's activations rebuilt in the backward"))
    else:
        training.append(
            Item(
                "LM head logits",
                acts.head,
                f"3 float32 [{min(tokens, chunk_rows(shape.vocab_size)):,} x {shape.vocab_size:,}]: one chunk's "
                "log-softmax, its exp, their product",
            )
        )
    stepping = [
        Item(
            "AdamW / serving temporaries",
            max(FLOAT32 * trained // shards, FLOAT32 * shape.largest_tensor_elements if config.lora is None else 0),
            "foreach AdamW's sqrt of a moment, or a whole tensor gathered in float32 to serve",
        )
    ]
    return LearnerPlan(
        layout=layout,
        world_size=world,
        gpu_memory_bytes=int(gpu_memory_gib * GIB),
        micro_batch_tokens=tokens,
        sequence_tokens=sequence_tokens,
        activation_checkpointing=config.activation_checkpointing,
        held=tuple(held),
        training=tuple(training),
        stepping=tuple(stepping),
    )


def _shard_note(shards: int) -> str:
    return f", 1/{shards} (FSDP2 shard)" if shards > 1 else ", whole"


def suggest_micro_batch_tokens(
    shape: ModelShape,
    config: LearnerConfig,
    *,
    gpus_per_node: int,
    nodes: int = 1,
    gpu_memory_gib: float = 80.0,
    sequence_tokens: int | None,
) -> int | None:
    """A round ``micro_batch_tokens`` that fits under ``config``'s other settings and is at least one
    sequence: the largest power of two, else multiple of 1024 or of 128, within 3/4 of the largest that
    fits; None when not even one sequence fits. ``sequence_tokens`` None (the sequences' length
    unknown): rows as wide as the micro-batch, from 128 tokens."""

    def total(tokens: int) -> int:
        return _plan_tokens(shape, config, tokens, gpus_per_node, nodes, gpu_memory_gib, sequence_tokens).total_bytes

    usable = int(USABLE_FRACTION * gpu_memory_gib * GIB)
    least = sequence_tokens or MIN_SUGGESTED_TOKENS
    if total(least) > usable:
        return None
    fits, too_many = least, 2 * least  # the bytes grow with the tokens: double, then bisect
    while total(too_many) <= usable and too_many < MAX_SUGGESTED_TOKENS:
        fits, too_many = too_many, 2 * too_many
    while too_many - fits > 1:
        middle = (fits + too_many) // 2
        fits, too_many = (middle, too_many) if total(middle) <= usable else (fits, middle)
    # A round number, not far below the largest that fits: a power of two, else a multiple of 1024 or 128.
    for candidate in (1 << (fits.bit_length() - 1), fits // 1024 * 1024, fits // 128 * 128):
        if candidate >= max(least, fits * 3 // 4):
            return candidate
    return fits


def _plan_tokens(
    shape: ModelShape,
    config: LearnerConfig,
    tokens: int,
    gpus_per_node: int,
    nodes: int,
    gpu_memory_gib: float,
    sequence_tokens: int | None,
) -> LearnerPlan:
    """``config`` with ``tokens`` a micro-batch, in rows of ``sequence_tokens`` (None: as wide as the micro-batch)."""
    return plan_learner(
        shape,
        config.model_copy(update={"micro_batch_tokens": tokens}),
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        gpu_memory_gib=gpu_memory_gib,
        sequence_tokens=sequence_tokens or tokens,
    )


def check_learner(
    shape: ModelShape,
    config: LearnerConfig,
    *,
    gpus_per_node: int,
    nodes: int = 1,
    gpu_memory_gib: float = 80.0,
    sequence_tokens: int | None,
    group_size: int = DEFAULT_GROUP_SIZE,
    settings_key: str = "",
) -> LearnerPlan:
    """The plan of one learner rank; ConfigError in one line when it does not fit, naming the setting to
    change and a ``micro_batch_tokens`` that fits (with activation checkpointing, and FSDP2, when needed).

    ``sequence_tokens``: prompt plus completion at their longest; None (not
    known) plans rows as wide as ``micro_batch_tokens``. ``settings_key``
    goes before each setting's name (where a file holds them, e.g.
    "learner.config.").
    """
    width = sequence_tokens or config.micro_batch_tokens
    if width is None:
        raise ConfigError(
            f"{settings_key}micro_batch_tokens is None: a GPU learner needs it set (asymptote plan suggests one)"
        )
    plan = plan_learner(
        shape,
        config,
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        gpu_memory_gib=gpu_memory_gib,
        sequence_tokens=width,
        group_size=group_size,
    )
    if plan.fits:
        return plan
    key = settings_key
    need = (
        f"{key}micro_batch_tokens {config.micro_batch_tokens}: a learner rank needs {plan.total_bytes / GIB:.1f} "
        f"GiB of its {gpu_memory_gib:g} GiB GPU, more than the {USABLE_FRACTION:.0%} planned"
    )
    # The cheapest change first: a smaller micro-batch, then recomputing activations, then sharding.
    changes: list[tuple[str, dict[str, Any]]] = [("", {})]
    if not config.activation_checkpointing:
        changes.append((f"{key}activation_checkpointing: true and ", {"activation_checkpointing": True}))
    if plan.layout == "ddp":
        changes.append(
            (
                f"{key}parallelism: fsdp, {key}activation_checkpointing: true and ",
                {"parallelism": "fsdp", "activation_checkpointing": True},
            )
        )
    where = (gpus_per_node, nodes, gpu_memory_gib, sequence_tokens)
    for setting, update in changes:
        changed = config.model_copy(update=update)
        tokens = suggest_micro_batch_tokens(
            shape,
            changed,
            gpus_per_node=gpus_per_node,
            nodes=nodes,
            gpu_memory_gib=gpu_memory_gib,
            sequence_tokens=sequence_tokens,
        )
        if tokens is not None:
            fitted = _plan_tokens(shape, changed, tokens, *where)
            raise ConfigError(
                f"{need}; set {setting}{key}micro_batch_tokens: {tokens} ({fitted.total_bytes / GIB:.1f} GiB)"
            )
    least = (
        f"one sequence of {sequence_tokens} tokens fits" if sequence_tokens else f"{MIN_SUGGESTED_TOKENS} tokens fit"
    )
    raise ConfigError(
        f"{need}; not even {least} with activation checkpointing: more GPUs "
        "(learner.gpusPerNode or learner.nodes: more FSDP2 shards) or a smaller max_tokens"
    )


def learner_fits(
    model_dir: Path,
    config: LearnerConfig,
    *,
    world_size: int,
    local_world_size: int,
    gpu_memory_bytes: int,
    sequence_tokens: int | None = None,
) -> LearnerPlan:
    """For the learner at start, before it allocates on its GPU: the plan of this rank from the model's
    config.json, torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE and the GPU's total memory. Without
    ``sequence_tokens`` (the learner does not know the broker's max_tokens) a row is planned as wide
    as ``micro_batch_tokens``. ConfigError in one line when it does not fit."""
    return check_learner(
        ModelShape.read(model_dir),
        config,
        gpus_per_node=local_world_size,
        nodes=max(1, world_size // local_world_size),
        gpu_memory_gib=gpu_memory_bytes / GIB,
        sequence_tokens=sequence_tokens,
    )


# -- generators, host memory, checkpoints --------------------------------------------------------------------


@dataclass(frozen=True)
class GeneratorSettings:
    """The engine settings a generator's memory depends on (services/generator/config.py EngineSettings)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "bfloat16"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    fp32_lm_head: bool = True


@dataclass(frozen=True)
class GeneratorPlan:
    """One generator GPU: its weights and KV cache."""

    gpu_memory_bytes: int
    weights_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    sequence_tokens: int
    max_num_seqs: int
    sized_by: str

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_cache_bytes) // self.kv_bytes_per_token

    @property
    def sequences(self) -> int:
        """Sequences of the longest length (prompt plus max_tokens) the KV cache holds at once."""
        return self.kv_tokens // self.sequence_tokens

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + max(0, self.kv_cache_bytes) + GENERATOR_RESERVE_BYTES


def plan_generator(
    shape: ModelShape, engine: GeneratorSettings, *, gpu_memory_gib: float = 80.0, sequence_tokens: int
) -> GeneratorPlan:
    """One GPU of a generator: weights (in the engine's dtype, shared over tensor parallelism), the FP32
    head's float32 copy of the LM head, and the KV cache, by its fixed size or by memory fraction."""
    gpu = int(gpu_memory_gib * GIB)
    tp = engine.tensor_parallel_size
    width = DTYPE_BYTES.get(engine.dtype, DTYPE_BYTES[shape.stored_dtype])
    weights = shape.num_parameters * width
    if engine.fp32_lm_head and width < FLOAT32:
        weights += shape.vocab_size * shape.hidden_size * (FLOAT32 - width)
    weights //= tp
    per_token = shape.kv_bytes_per_token_element * width // min(tp, shape.num_kv_heads)
    if engine.kv_cache_memory_bytes is not None:
        kv, sized_by = engine.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    else:
        kv = int(engine.gpu_memory_utilization * gpu) - weights - GENERATOR_RESERVE_BYTES
        sized_by = f"gpu_memory_utilization {engine.gpu_memory_utilization:g}"
    return GeneratorPlan(gpu, weights, kv, per_token, sequence_tokens, engine.max_num_seqs, sized_by)


def check_generator(plan: GeneratorPlan) -> None:
    """ConfigError in one line when a generator GPU cannot hold its weights and one longest sequence's KV."""
    if plan.total_bytes > plan.gpu_memory_bytes and plan.sized_by == "kv_cache_memory_bytes":
        raise ConfigError(
            f"generator: weights {plan.weights_bytes / GIB:.1f} GiB + kv_cache_memory_bytes "
            f"{plan.kv_cache_bytes / GIB:.1f} GiB + {GENERATOR_RESERVE_BYTES / GIB:.0f} GiB reserve exceed the "
            f"{plan.gpu_memory_bytes / GIB:g} GiB GPU; set kv_cache_memory_bytes: null to size it by gpu_memory_utilization"
        )
    if plan.sequences < 1:
        raise ConfigError(
            f"generator: the KV cache ({plan.sized_by}) holds {plan.kv_tokens:,} tokens, less than one sequence of "
            f"{plan.sequence_tokens:,}; raise gpu_memory_utilization or tensor_parallel_size (generator.gpus)"
        )


@dataclass(frozen=True)
class HostPlan:
    """Host memory of one learner pod and the checkpoints on its volume."""

    load_bytes: int
    """Each rank reading one tensor at a time in float32, all the pod's ranks at once."""
    served_bytes: int
    """The versions rank 0 keeps to serve (pod 0)."""
    staging_bytes: int
    """The pod's ranks staging their shards of an async checkpoint."""
    checkpoint_bytes: int
    """One checkpoint on disk, all ranks' shards together."""
    checkpoints_on_disk: int
    """Kept checkpoints (the newest, the best held-out round's) plus the one being written."""

    @property
    def host_bytes(self) -> int:
        return self.load_bytes + self.served_bytes + self.staging_bytes

    @property
    def disk_bytes(self) -> int:
        return self.checkpoint_bytes * self.checkpoints_on_disk


def plan_host(shape: ModelShape, config: LearnerConfig, *, gpus_per_node: int, nodes: int = 1) -> HostPlan:
    """A learner pod's host memory (the process's own, torch and CUDA, aside) and its checkpoints.

    The learner loads on the meta device and materialises only its own
    shards, one safetensors tensor at a time: about the largest tensor in
    float32 per rank. Rank 0 keeps ``served_versions_kept`` whole versions in
    the model's stored dtype, and one more being copied out (on a GPU all of
    them in page-locked buffers it keeps for reuse). Checkpoints are torch.distributed.checkpoint
    async saves: each rank stages its shard of float32 weights and both AdamW
    moments (12 bytes a parameter over the world) in host memory.
    """
    p, world = shape.num_parameters, gpus_per_node * nodes
    # A LoRA serves and checkpoints its adapter only, served in float32.
    trained = p if config.lora is None else adapter_parameters(shape, config.lora)
    served = p * DTYPE_BYTES[shape.stored_dtype] if config.lora is None else trained * FLOAT32
    return HostPlan(
        load_bytes=gpus_per_node * FLOAT32 * shape.largest_tensor_elements,
        served_bytes=(config.served_versions_kept + 1) * served,
        staging_bytes=CHECKPOINT_BYTES_PER_PARAM * trained * gpus_per_node // world,
        checkpoint_bytes=CHECKPOINT_BYTES_PER_PARAM * trained + CHECKPOINT_EXTRA_BYTES,
        checkpoints_on_disk=config.keep_checkpoints + int(config.keep_best_checkpoint) + 1,
    )


@dataclass(frozen=True)
class RunPlan:
    """Everything ``asymptote plan`` prints."""

    shape: ModelShape
    learner: LearnerPlan
    generator: GeneratorPlan
    host: HostPlan
    prompt_tokens: int
    max_tokens: int


def plan_run(
    shape: ModelShape,
    config: LearnerConfig,
    engine: GeneratorSettings,
    *,
    gpus_per_node: int,
    nodes: int = 1,
    gpu_memory_gib: float = 80.0,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    max_tokens: int,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> RunPlan:
    """The learner rank, a generator GPU, a learner pod's host memory and its checkpoints, unchecked."""
    sequence = prompt_tokens + max_tokens
    return RunPlan(
        shape=shape,
        learner=plan_learner(
            shape,
            config,
            gpus_per_node=gpus_per_node,
            nodes=nodes,
            gpu_memory_gib=gpu_memory_gib,
            sequence_tokens=sequence,
            group_size=group_size,
        ),
        generator=plan_generator(shape, engine, gpu_memory_gib=gpu_memory_gib, sequence_tokens=sequence),
        host=plan_host(shape, config, gpus_per_node=gpus_per_node, nodes=nodes),
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
    )
