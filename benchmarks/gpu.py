"""The learner's GPU path, measured on one GPU with PyTorch alone: one script, one JSON.

Owns the figures a first GPU run needs and no CPU machine can give:

- **step**: the learner's optimizer step (``Trainer.step`` on collated rollout
  groups: float32 masters, bf16 body, the configured head, micro-batches of
  padded rows) against a bare PyTorch step on the same model and tokens
  (bf16 parameters, fused AdamW, sequences packed into rows without padding),
  interleaved; tokens per second and MFU (6 x parameters x tokens/s over the
  card's bf16 peak) of each, and the padded share of the learner's tokens;
- **head**: the LM head's forward and backward alone for each head setting
  (``fp32``, ``bf16_fp32_acc``), and its share of a learner step;
- **activations**: bytes a token of one sequence adds to the peak, forward
  and backward, at T = 2k and 8k, without and with activation checkpointing;
- **fsdp**: FSDP2 on NCCL at world size 1 (the sharded code path: two steps
  with gradient clipping on DTensors, the step's broadcast, ``sum`` and
  ``max``), serving a version from the shards (GB/s of the served dtype),
  and a ``torch.distributed.checkpoint`` save and load;
- **staging**: host to device copies from pageable and pinned memory and a
  device to device copy (GB/s), and the pause they project for a 16 GB
  (8B bf16) swap; and the generator's own staging (``worker_ext``): a
  version mapped from tmpfs, then copied into pinned buffers or onto the
  device while an engine would generate, checked byte for byte, and the
  placement ``auto`` picks.

    python -m benchmarks.gpu --output DIR            # one GPU: a random Qwen3-0.6B shape
    python -m benchmarks.gpu --output DIR --device cpu --quick   # the same code, tiny, on the CPU

Each part runs on its own: one that fails is recorded with its error and
the others still run; the JSON (``gpu_bench.json``) is rewritten after each
part, so a run cut short keeps what it measured. Needs no vLLM, NATS or
network. Sized for at most 8 minutes on one H100 (``BUDGET_S``; each part's
seconds are in the file).

Targets: the whole run within ``BUDGET_S``; the learner's tokens per second
at least ``STEP_TARGET`` of the bare step's (the learner pays for float32
masters, the FP32 head and padding; packing is what closes the rest).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import random
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from asymptote.contracts.v1 import rollout_pb2
from services.learner import checkpoint
from services.learner.attention import sequence_lengths, use_packed_attention
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.distributed import DataParallel
from services.learner.head import HeadPrecision, head_logprobs
from services.learner.host_buffers import HostBuffers
from services.learner.model import PackedBatch, Precision, count_parameters
from services.learner.sharding import checkpoint_activations
from services.learner.trainer import StepInputs, Trainer, collate, select_rows
from services.learner.weights import Version, WeightStore, served_signature

BENCH_FILE_NAME = "gpu_bench.json"
BUDGET_S = 480.0
STEP_TARGET = 0.5
SWAP_BYTES = 16e9
"""A swap's bytes at 8B in bf16, for the projected pause."""

PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 peak by card name (the vendor's sheets, SXM parts)."""


@dataclass(frozen=True)
class Shape:
    """A Qwen3 decoder's shape and the workload put through it."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    prompts: int
    group_size: int
    prompt_len: int
    median_len: int
    max_len: int
    micro_batch_tokens: int
    pack_tokens: int
    activation_lengths: tuple[int, ...]
    fsdp_prompts: int
    staging_bytes: int
    repeats: int


FULL = Shape(
    vocab=151_936,
    hidden=1024,
    intermediate=3072,
    layers=28,
    heads=16,
    kv_heads=8,
    head_dim=128,
    prompts=16,
    group_size=8,
    prompt_len=256,
    median_len=384,
    max_len=4096,
    micro_batch_tokens=8192,
    pack_tokens=8192,
    activation_lengths=(2048, 8192),
    fsdp_prompts=4,
    staging_bytes=2 << 30,
    repeats=3,
)
"""Qwen3-0.6B (tied embeddings), 16 prompts x 8 completions with ScaleRL's long-tailed lengths."""

QUICK = Shape(
    vocab=512,
    hidden=64,
    intermediate=128,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    prompts=4,
    group_size=2,
    prompt_len=8,
    median_len=8,
    max_len=24,
    micro_batch_tokens=96,
    pack_tokens=96,
    activation_lengths=(32, 64),
    fsdp_prompts=2,
    staging_bytes=8 << 20,
    repeats=1,
)


def qwen3_model(shape: Shape, device: torch.device) -> PreTrainedModel:
    """A Qwen3 causal LM of ``shape`` on the meta device (the Trainer allocates it), SDPA on GPUs."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max(40_960, shape.max_len + shape.prompt_len),
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="sdpa" if device.type == "cuda" else "eager"
        )
    return model


def long_tailed_groups(shape: Shape, prompts: int, seed: int = 0) -> list[rollout_pb2.RolloutGroup]:
    """Rollout groups with ScaleRL's lengths: log-normal (sigma 1) about the median, cut at the cap."""
    rng = random.Random(seed)
    groups = []
    for p in range(prompts):
        completions = []
        for i in range(shape.group_size):
            n = max(1, min(shape.max_len, round(rng.lognormvariate(math.log(shape.median_len), 1.0))))
            completions.append(
                rollout_pb2.Completion(
                    token_ids=[rng.randrange(4, shape.vocab) for _ in range(n)],
                    logprobs=[-rng.uniform(0.01, 3.0) for _ in range(n)],
                    version_spans=[rollout_pb2.VersionSpan(version=0, start=0, end=n)],
                    reward=float(i % 2),
                    truncated=n == shape.max_len,
                )
            )
        groups.append(
            rollout_pb2.RolloutGroup(
                group_id=f"g{p}",
                task=rollout_pb2.GenerationTask(
                    task_id=f"g{p}",
                    kind=rollout_pb2.TASK_KIND_TRAIN,
                    sampling=rollout_pb2.SamplingParams(temperature=1.0),
                ),
                prompt_token_ids=[rng.randrange(4, shape.vocab) for _ in range(shape.prompt_len)],
                completions=completions,
            )
        )
    return groups


class Clock:
    """Wall seconds of a block, the device's queued work included."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def peak_flops(device: torch.device) -> tuple[str, float | None]:
    """The card's name and its dense bf16 peak (None for a card not in the table, and for the CPU)."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


# -- the bare step ------------------------------------------------------------


@dataclass(frozen=True)
class PackedRows:
    """Sequences laid end to end in rows of at most a token budget, no padding (position ids restart)."""

    input_ids: list[torch.Tensor]
    position_ids: list[torch.Tensor]
    completion_at: list[torch.Tensor]
    """Per row: positions whose next token is a completion token (its logits are scored)."""
    logp_gen: list[torch.Tensor]
    advantages: list[torch.Tensor]
    lengths: list[torch.Tensor]
    """Per row: each sequence's length, in order."""
    tokens: int


def pack_rows(groups: list[rollout_pb2.RolloutGroup], budget: int, device: torch.device) -> PackedRows:
    """First-fit of whole sequences (prompt + completion) into rows of at most ``budget`` tokens."""
    rows: list[dict[str, list[Any]]] = []
    for g in groups:
        rewards = torch.tensor([c.reward for c in g.completions])
        adv = ((rewards - rewards.mean()) / rewards.std().clamp_min(1e-8)).tolist()
        for c, a in zip(g.completions, adv):
            seq = list(g.prompt_token_ids) + list(c.token_ids)
            row = next((r for r in rows if len(r["ids"]) + len(seq) <= budget), None)
            if row is None:
                row = {"ids": [], "pos": [], "at": [], "gen": [], "adv": [], "len": []}
                rows.append(row)
            start = len(row["ids"])
            row["ids"] += seq
            row["pos"] += list(range(len(seq)))
            first = start + len(g.prompt_token_ids) - 1
            row["at"] += list(range(first, first + len(c.token_ids)))
            row["gen"] += list(c.logprobs)
            row["adv"] += [a] * len(c.token_ids)
            row["len"].append(len(seq))

    def put(key: str, dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.tensor(r[key], dtype=dtype, device=device) for r in rows]

    return PackedRows(
        input_ids=[t[None] for t in put("ids", torch.long)],
        position_ids=[t[None] for t in put("pos", torch.long)],
        completion_at=put("at", torch.long),
        logp_gen=put("gen", torch.float32),
        advantages=put("adv", torch.float32),
        lengths=[torch.tensor(r["len"]) for r in rows],
        tokens=sum(len(r["ids"]) for r in rows),
    )


def bare_step(model: Any, opt: torch.optim.Optimizer, rows: PackedRows, eps_max: float) -> None:
    """Forward, CISPO's token loss, backward, clipping and fused AdamW, bf16 throughout, one packed row at a time
    (the learner's packed attention: the same kernel, so the difference is the learner's own)."""
    opt.zero_grad(set_to_none=True)
    total = sum(int(a.numel()) for a in rows.completion_at)
    head = model.get_output_embeddings().weight
    for ids, pos, at, gen, adv, lengths in zip(
        rows.input_ids, rows.position_ids, rows.completion_at, rows.logp_gen, rows.advantages, rows.lengths
    ):
        bounds = sequence_lengths(lengths, ids.device)
        hidden = model.base_model(input_ids=ids, position_ids=pos, use_cache=False, **bounds).last_hidden_state[0, at]
        logits = (hidden @ head.t()).float()
        logp = torch.log_softmax(logits, -1).gather(1, ids[0, at + 1, None]).squeeze(1)
        w = torch.exp(logp.detach() - gen).clamp(max=eps_max)
        (-(w * adv * logp).sum() / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


# -- the parts ----------------------------------------------------------------


def _tokens(groups: list[rollout_pb2.RolloutGroup]) -> int:
    return sum(len(g.prompt_token_ids) + len(c.token_ids) for g in groups for c in g.completions)


def part_step(shape: Shape, device: torch.device, clock: Clock) -> dict[str, Any]:
    """The learner's step, packed and padded and for each head setting, against the bare step, interleaved."""
    from transformers import AutoModelForCausalLM

    groups = long_tailed_groups(shape, shape.prompts)
    inputs = collate(groups, shape.vocab - 1)
    real = _tokens(groups)
    padded = int(inputs.batch.input_ids.numel())
    model = qwen3_model(shape, device)
    base_attention = model.config._attn_implementation
    loss = LossSettings()
    precision = Precision.resolve("cuda" if device.type == "cuda" else "cpu", local_rank=device.index or 0)
    trainer = Trainer(
        model, loss, OptimizerSettings(warmup_steps=0), precision=precision, micro_batch_tokens=shape.micro_batch_tokens
    )
    trainer.init_random()
    params = count_parameters(model)
    with torch.device(device):
        bare = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    bare.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    use_packed_attention(bare)
    bare.train()
    bare_opt = torch.optim.AdamW(bare.parameters(), lr=1e-6, fused=device.type == "cuda")
    rows = pack_rows(groups, shape.pack_tokens, device)

    default: HeadPrecision = precision.head
    # (name, packed, head): the default first; fp32's head where the default is another
    variants: list[tuple[str, bool, HeadPrecision]] = [("packed", True, default), ("padded", False, default)]
    if default != "fp32":
        variants.append(("packed_fp32_head", True, "fp32"))
    learner_s: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    bare_s: list[float] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(shape.repeats + 1):
        for name, packed, head in variants:
            if packed:
                use_packed_attention(model)
            else:
                model.set_attn_implementation(base_attention)
            trainer.precision = Precision(precision.device, precision.compute_dtype, head)
            trainer.policy.precision = trainer.precision  # type: ignore[assignment]
            took = clock.time(lambda: trainer.step(inputs, learner_version=0))
            if i:  # the first of each is a warm-up
                learner_s[name].append(took)
        took = clock.time(lambda: bare_step(bare, bare_opt, rows, loss.eps_max))
        if i:
            bare_s.append(took)
    card, peak = peak_flops(device)
    bare_med = statistics.median(bare_s)
    agreement = _packed_vs_padded(trainer, model, base_attention, inputs, rows=16)
    out: dict[str, Any] = {
        "card": card,
        "parameters": params,
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_share_padded": 1 - real / padded,
        "padding_share_packed": 0.0,
        "micro_batch_tokens": shape.micro_batch_tokens,
        "bare_packed_rows": len(rows.input_ids),
        "bare_step_s": bare_med,
        "bare_tokens_per_s": real / bare_med,
        "bare_mfu": None if peak is None else 6 * params * real / bare_med / peak,
        "peak_bf16_flops": peak,
        "head_default": default,
        **agreement,
        "target": f"learner (packed) tokens/s >= {STEP_TARGET} x bare",
    }
    for name, _, _ in variants:
        med = statistics.median(learner_s[name])
        out[f"learner_{name}_step_s"] = med
        out[f"learner_{name}_tokens_per_s"] = real / med
        out[f"learner_{name}_mfu"] = None if peak is None else 6 * params * real / med / peak
        out[f"learner_{name}_vs_bare"] = bare_med / med
    out["packed_speedup_over_padded"] = out["learner_padded_step_s"] / out["learner_packed_step_s"]
    out["met"] = out["learner_packed_vs_bare"] >= STEP_TARGET
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    completion_tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
    step_of = {head: out[f"learner_{name}_step_s"] for name, packed, head in variants if packed}
    out.update(part_head_alone(shape, device, clock, completion_tokens, step_of))
    return out


@torch.no_grad()
def _packed_vs_padded(
    trainer: Trainer, model: PreTrainedModel, base_attention: str, inputs: StepInputs, rows: int
) -> dict[str, float]:
    """How far the packed layout's log-probs are from the padded layout's on the first ``rows`` completions."""
    batch = select_rows(inputs.batch, torch.arange(min(rows, inputs.batch.input_ids.shape[0])))
    temps = inputs.temperature[: batch.input_ids.shape[0]]
    model.set_attn_implementation(base_attention)
    padded, _ = trainer.policy(batch, temps)
    use_packed_attention(model)
    packed, _ = trainer.policy(batch, temps)
    gap = (packed - padded)[batch.completion_mask.bool().to(packed.device)].abs()
    return {"packed_vs_padded_logp_max_abs": float(gap.max()), "packed_vs_padded_logp_mean_abs": float(gap.mean())}


def part_head_alone(
    shape: Shape, device: torch.device, clock: Clock, tokens: int, step_s: dict[HeadPrecision, float]
) -> dict[str, Any]:
    """The head's forward and backward on a step's completion tokens, alone, and its share of that step."""
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, shape.hidden, device=device, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(shape.vocab, shape.hidden, device=device, generator=gen, requires_grad=True)
    targets = torch.randint(0, shape.vocab, (tokens,), device=device, generator=gen)
    inv_t = torch.ones(tokens, device=device)
    out: dict[str, Any] = {}
    for h, whole in step_s.items():

        def run(h: HeadPrecision = h) -> None:
            logp, _ = head_logprobs(hidden, weight, None, targets, inv_t, h)
            logp.sum().backward()

        run()
        took = statistics.median(clock.time(run) for _ in range(max(1, shape.repeats)))
        out[f"head_{h}_s"] = took
        out[f"head_{h}_share_of_packed_step"] = took / whole
    return out


def part_activations(shape: Shape, device: torch.device, clock: Clock) -> dict[str, Any]:
    """Peak bytes a token adds in one sequence's forward and backward (gradients already allocated)."""
    model = qwen3_model(shape, device)
    precision = Precision.resolve("cuda" if device.type == "cuda" else "cpu", local_rank=device.index or 0)
    trainer = Trainer(model, LossSettings(), OptimizerSettings(warmup_steps=0), precision=precision)
    trainer.init_random()
    out: dict[str, Any] = {}
    for checkpointing in (False, True):
        if checkpointing:
            checkpoint_activations(model)
        for length in shape.activation_lengths:
            prompt = shape.prompt_len
            ids = torch.randint(4, shape.vocab, (1, length))
            batch = PackedBatch(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                position_ids=torch.arange(length)[None],
                prompt_len=prompt,
                completion_mask=torch.ones(1, length - prompt, dtype=torch.long),
            ).to(device)

            def fwd_bwd(batch: PackedBatch = batch) -> None:
                logp, _ = trainer.policy(batch, torch.ones(1))
                logp.sum().backward()

            fwd_bwd()  # gradients allocated, kernels chosen
            key = f"T{length}_{'checkpointed' if checkpointing else 'plain'}"
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                took = clock.time(fwd_bwd)
                out[f"{key}_bytes_per_token"] = (torch.cuda.max_memory_allocated(device) - before) / length
            else:
                took = clock.time(fwd_bwd)
                out[f"{key}_bytes_per_token"] = None  # the CPU allocator keeps no peak
            out[f"{key}_s"] = took
    return out


class _OneRankGroup(DataParallel):
    """Rank 0 of a process group of one, taking the sharded path a group of several takes."""

    @property
    def distributed(self) -> bool:
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[str]:
    """A process group of one (NCCL on a GPU, gloo on the CPU) for the block."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def part_fsdp(shape: Shape, device: torch.device, clock: Clock) -> dict[str, Any]:
    """FSDP2 over a group of one: two steps, the collectives, serving from shards, a DCP save and load."""
    out: dict[str, Any] = {}
    with process_group(device) as backend, tempfile.TemporaryDirectory(prefix="asy-gpu-dcp-") as root:
        out["backend"] = backend
        dp = _OneRankGroup()
        model = qwen3_model(shape, device)
        precision = Precision.resolve("cuda" if device.type == "cuda" else "cpu", local_rank=device.index or 0)
        trainer = Trainer(
            model,
            LossSettings(),
            OptimizerSettings(warmup_steps=0),
            dp=dp,
            precision=precision,
            parallelism="fsdp",
            micro_batch_tokens=shape.micro_batch_tokens,
        )
        if not trainer.sharded:
            raise RuntimeError("the trainer did not take the FSDP2 path")
        trainer.init_random()
        inputs = collate(long_tailed_groups(shape, shape.fsdp_prompts, seed=1), shape.vocab - 1)
        metrics: list[dict[str, float]] = []
        out["step_s"] = [clock.time(lambda: metrics.append(trainer.step(inputs, len(metrics)))) for _ in range(2)]
        norms = [m.get("optim/grad_norm", math.nan) for m in metrics]
        out["grad_norms"] = norms
        if not all(math.isfinite(n) and n > 0 for n in norms):
            raise RuntimeError(f"gradient norms on DTensors are not finite and positive: {norms}")
        sums = dp.sum(torch.tensor([1.0, 2.0]))
        maxes = dp.max(torch.tensor([3.0, -1.0]))
        if sums.tolist() != [1.0, 2.0] or maxes.tolist() != [3.0, -1.0]:
            raise RuntimeError(f"sum or max over a group of one changed the values: {sums}, {maxes}")
        out["broadcast"] = dp.broadcast({"step": 2}) == {"step": 2}

        # Served into pageable memory, then into page-locked buffers (the learner's way on a GPU), three times
        # each: the store keeps one version, so the first two lock a buffer each and the third reuses the first.
        signature = served_signature(model, "bfloat16")
        for key, buffers in (("serve", None), ("serve_pinned", HostBuffers.for_device(device))):
            store = WeightStore(signature, keep=1, host_buffers=buffers)
            served: list[Version] = []

            def serve(version: int, store: WeightStore = store, served: list[Version] = served) -> None:
                served[:] = [store.snapshot_tensors(version, trainer.served_tensors(store.names))]

            times = [clock.time(functools.partial(serve, v)) for v in (1, 2, 3)]
            out[f"{key}_s"] = times
            out[f"{key}_bytes"] = served[-1].num_bytes
            out[f"{key}_gb_per_s"] = served[-1].num_bytes / min(times) / 1e9
            out[f"{key}_digest"] = served[-1].digest
            out[f"{key}_buffers"] = 0 if buffers is None else buffers.num_buffers
        if out["serve_pinned_digest"] != out["serve_digest"]:
            raise RuntimeError("the version served through page-locked buffers differs from the pageable one")

        trainer.checkpointer = checkpoint.Checkpointer(Path(root), keep=2, distributed=True, rank=0)
        probe = next(p for p in model.parameters() if p.requires_grad)
        saved = _local(probe).clone()
        out["dcp_stage_s"] = clock.time(lambda: trainer.save(2, trainer.meta(2, 2)))
        finished: dict[str, Path | None] = {}
        out["dcp_commit_s"] = clock.time(lambda: finished.update(path=trainer.checkpointer.finish()))  # type: ignore[union-attr]
        path = finished["path"]
        if path is None:
            raise RuntimeError("the checkpoint was not committed")
        out["dcp_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        with torch.no_grad():
            probe.add_(1.0)
        out["dcp_load_s"] = clock.time(lambda: trainer.start(None, resume=path))
        if not torch.equal(_local(probe), saved):
            raise RuntimeError("the weights read back from the checkpoint are not the ones saved")
        out["dcp_round_trip"] = True
        trainer.close()
    return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (itself when it is not sharded)."""
    from torch.distributed.tensor import DTensor

    local: torch.Tensor = tensor.detach().to_local() if isinstance(tensor, DTensor) else tensor.detach()  # type: ignore[attr-defined]
    return local


def part_staging(shape: Shape, device: torch.device, clock: Clock) -> dict[str, Any]:
    """Copies a swap makes, GB/s, and the pause each projects for a 16 GB version."""
    n = shape.staging_bytes
    pageable = torch.empty(n, dtype=torch.uint8).random_(0, 255)
    target = torch.empty(n, dtype=torch.uint8, device=device)
    sources: dict[str, torch.Tensor] = {"pageable_to_device": pageable}
    if device.type == "cuda":
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(pageable)
        sources["pinned_to_device"] = pinned
        sources["device_to_device"] = pageable.to(device)
    out: dict[str, Any] = {"bytes": n}
    for name, src in sources.items():

        def copy(src: torch.Tensor = src) -> None:
            target.copy_(src, non_blocking=True)

        copy()
        took = statistics.median(clock.time(copy) for _ in range(3))
        rate = n / took
        out[f"{name}_gb_per_s"] = rate / 1e9
        out[f"{name}_pause_16gb_s"] = SWAP_BYTES / rate
    out.update(generator_staging(n, device))
    return out


def generator_staging(num_bytes: int, device: torch.device) -> dict[str, Any]:
    """The generator's staging of a version of ``num_bytes`` (bf16, eight tensors) written to tmpfs:
    mapping it, and on a GPU copying it to each placement (twice: pinned buffers are kept and reused),
    GB/s, with the copies checked against the file."""
    from safetensors.torch import save_file

    from services.generator.worker_ext import _mapped, _staged_copy, choose_placement

    rows = max(1, num_bytes // (8 * 1024 * 2))
    tensors = {f"layers.{i}.weight": torch.randn(rows, 1024).to(torch.bfloat16) for i in range(8)}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="gpu-bench-staging-", dir=shm if shm.is_dir() else None) as tmp:
        file = Path(tmp) / "model.safetensors"
        save_file(tensors, str(file))
        out: dict[str, Any] = {
            "generator_staging_bytes": size,
            "auto_placement": choose_placement("auto", device, size),
        }
        t0 = time.perf_counter()
        mapped = _mapped([file])
        out["mapped_gb_per_s"] = size / (time.perf_counter() - t0) / 1e9
        if device.type != "cuda":
            return out
        for placement in ("pinned", "device"):
            keep: dict[str, Any] = {}
            for attempt in ("first", "again"):
                t0 = time.perf_counter()
                staged = _staged_copy(mapped, placement, device, keep)
                out[f"stage_{placement}_{attempt}_gb_per_s"] = size / (time.perf_counter() - t0) / 1e9
            if not all(torch.equal(staged[k].cpu(), t) for k, t in tensors.items()):
                raise RuntimeError(f"the {placement} staging differs from the file it staged")
            del staged
        return out


PARTS: dict[str, Callable[[Shape, torch.device, Clock], dict[str, Any]]] = {
    "step": part_step,
    "activations": part_activations,
    "fsdp": part_fsdp,
    "staging": part_staging,
}


def run(device: torch.device, quick: bool, output: Path, only: list[str] | None = None) -> dict[str, Any]:
    """Every part in turn, each on its own; the JSON rewritten after each."""
    shape = QUICK if quick else FULL
    torch.manual_seed(0)
    report: dict[str, Any] = {
        "device": peak_flops(device)[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "quick": quick,
        "budget_s": BUDGET_S,
        "parts": {},
    }
    output.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for name, part in PARTS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        print(f"[gpu bench] {name} ...", flush=True)
        try:
            result: dict[str, Any] = {"ok": True, **part(shape, device, Clock(device))}
        except Exception as exc:  # a part that fails is a finding; the others still run
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-4000:]}
        result["wall_s"] = time.perf_counter() - t0
        report["parts"][name] = result
        report["wall_s"] = time.perf_counter() - started
        report["within_budget"] = report["wall_s"] <= BUDGET_S
        (output / BENCH_FILE_NAME).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"[gpu bench] {name}: {_summary(result)}", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


def _summary(result: dict[str, Any]) -> str:
    if not result["ok"]:
        return f"FAILED {result['error']}"
    keys = [k for k, v in result.items() if isinstance(v, float) and (not k.endswith("_s") or k.endswith("per_s"))]
    return ", ".join(f"{k}={result[k]:.4g}" for k in keys[:8]) + f" ({result['wall_s']:.1f} s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME}")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--quick", action="store_true", help="a tiny model and workload (the fast test tier's run)")
    parser.add_argument("--only", nargs="+", choices=sorted(PARTS), help="run only these parts")
    args = parser.parse_args(argv)
    chosen = args.device
    if chosen == "auto":
        chosen = "cuda" if torch.cuda.is_available() else "cpu"
    if chosen == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    device = torch.device("cuda", torch.cuda.current_device()) if chosen == "cuda" else torch.device("cpu")
    report = run(device, args.quick, args.output, args.only)
    failed = [k for k, v in report["parts"].items() if not v["ok"]]
    print(f"[gpu bench] wrote {args.output / BENCH_FILE_NAME} in {report['wall_s']:.0f} s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
