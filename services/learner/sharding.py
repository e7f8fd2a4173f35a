"""How the policy is laid out over the learner's ranks: DDP or FSDP2, activation checkpointing, full state.

Owns choosing between a DDP replica per rank and FSDP2 sharding
(``torch.distributed.fsdp.fully_shard``, one group per decoder layer and
one for the root, which holds the embeddings, the final norm and the LM
head), recomputing decoder layers' activations in the backward pass, the
gradient norm and clipping over sharded or whole gradients, and turning
sharded parameters and optimizer state back into full tensors by name (for
checkpoints and for the weights served to generators) and back again.
Decoder layers are found through the model's own ``_no_split_modules``, the
classes transformers itself keeps whole when it splits a model, so nothing
here names an architecture. Knows nothing about losses, batches or the
service; ``trainer`` decides when each piece runs and which ranks join.

Under FSDP2 every rank must call the collective pieces (``full_tensor``,
``full_state``, ``load_full_state``) in the same order; ``Trainer`` tells
the other ranks what rank 0 is about to do.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from services.learner.layers import decoder_layers
from services.learner.model import Precision, aliases

Parallelism = Literal["auto", "fsdp", "ddp"]
Layout = Literal["fsdp", "ddp"]

_FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Gather every parameter and optimizer tensor whole, kept on rank 0's CPU only (the others get nothing)."""


def resolve_parallelism(parallelism: Parallelism, device: torch.device) -> Layout:
    """``auto``: FSDP2 on GPUs, DDP on the CPU.

    On the CPU the gloo backend makes FSDP2's per-layer all-gathers and
    reduce-scatters slower than DDP's one all-reduce (docs/benchmarks.md),
    and a CPU learner's model fits in host memory; on GPUs memory is the
    limit and NCCL overlaps the gathers with compute.
    """
    if parallelism == "auto":
        return "fsdp" if device.type == "cuda" else "ddp"
    return parallelism


def checkpoint_activations(model: torch.nn.Module) -> int:
    """Recompute every decoder layer's forward in the backward pass instead of keeping its activations.

    The layer's ``forward`` is wrapped in place (non-reentrant
    ``torch.utils.checkpoint``), so parameter names, state dicts and FSDP2's
    hooks on the layer stay as they are. Returns the number of layers.
    """
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)  # type: ignore[method-assign]
    return len(layers)


def shard(policy: torch.nn.Module, model: torch.nn.Module, precision: Precision) -> None:
    """FSDP2 over the process group: each decoder layer of ``model``, then ``policy`` (the root) itself.

    ``policy`` is the module whose forward the trainer calls (it holds
    ``model``), so the root's parameters (embeddings, final norm, LM head)
    are gathered around that call. Layers compute in the body's compute
    dtype (bf16 on GPUs: ``MixedPrecisionPolicy(param_dtype=bf16)``); the
    root keeps float32 parameters, so the LM head's weight reaches the FP32
    head unrounded. Gradients are reduced in float32 and the sharded master
    weights and AdamW state stay float32.
    """
    mesh = init_device_mesh(precision.device.type, (dist.get_world_size(),))
    body = MixedPrecisionPolicy(
        param_dtype=None if precision.compute_dtype == torch.float32 else precision.compute_dtype,
        reduce_dtype=torch.float32,
    )
    groups = decoder_layers(model)
    for layer in groups:
        fully_shard(layer, mesh=mesh, mp_policy=body)
    fully_shard(policy, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    if dist.get_backend() == "gloo":
        for module in [*groups, policy]:
            module.set_custom_reduce_scatter(_AllReduceInPlace())  # type: ignore[operator]


class _AllReduceInPlace(ReduceScatter):
    """gloo's reduce-scatter as an in-place all-reduce of FSDP2's own buffer, then this rank's chunk.

    gloo has no reduce-scatter of its own: torch's fallback all-reduces a
    clone of the whole input, and on the CPU those layer-sized clones
    outlived their step often enough to add several layers to a rank's
    peak (docs/benchmarks.md). The buffer here is FSDP2's scratch, free to
    overwrite; the bytes on the wire are the same.
    """

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        assert not async_op, "FSDP2 reduce-scatters synchronously on the CPU"
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(dist.get_world_size(group), -1)[dist.get_rank(group)])
        return None


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every rank when it is a shard (a collective), else itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Scale gradients to a global L2 norm of at most ``max_norm``; returns the norm before clipping.

    The norm of sharded gradients is summed over ranks first (a collective),
    so every rank clips by the same factor and reports the same norm.
    """
    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
    total = full_tensor(total)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return float(total)


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Whole parameters and AdamW state by parameter name, on rank 0's CPU (a collective when sharded).

    Rank 0 (or a lone process) gets the model's state dict without aliases
    and the optimizer's state keyed by parameter name, so either loads into
    any number of ranks and either layout; the other ranks get empty dicts.
    """
    names = aliases(model)
    weights = {k: v for k, v in get_model_state_dict(model, options=_FULL_ON_RANK0).items() if k not in names}
    assert all(isinstance(v, torch.Tensor) for v in weights.values()), "a model's state dict holds tensors"
    if not optimizer.state:
        # Before the first optimizer step: get_optimizer_state_dict would take a zero step to create
        # the state (AdamW's step count would then start at 1); keep it empty, as a fresh optimizer's.
        return cast(dict[str, torch.Tensor], weights), {}
    optimizer_state = dict(get_optimizer_state_dict(model, optimizer, options=_FULL_ON_RANK0))
    return cast(dict[str, torch.Tensor], weights), optimizer_state


def load_full_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    from_rank0: bool,
    with_optimizer_state: bool = True,
) -> None:
    """Load ``full_state``'s dicts. ``from_rank0``: a collective; rank 0 passes them and the others
    pass empty dicts, and each rank keeps its own shards. ``with_optimizer_state`` False (saved before
    any optimizer step) leaves the optimizer fresh; every rank passes the same. ValueError when the
    names do not fit."""
    if not from_rank0 or not dist.is_initialized() or dist.get_rank() == 0:
        weights = dict(weights)
        for alias, name in aliases(model).items():
            if alias not in weights and name in weights:
                weights[alias] = weights[name]
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        if missing or unexpected:
            raise ValueError(
                f"the saved weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0)
    set_model_state_dict(model, cast(dict[str, Any], weights), options=options)
    if with_optimizer_state:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
