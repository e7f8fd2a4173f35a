"""A CPU engine's next version, built beside the live model while it generates (runs inside vLLM's worker).

Owns ``prepare`` and ``Prepared.apply``, finding a tied LM head, and packing
a reloaded MoE layer's experts (``repack_experts``). vLLM's
CPU build keeps each linear layer's weight only as a oneDNN (or SGL) handle
packed from it, so loading a version is not a copy: the in-place layerwise
reload materialises each layer, loads it, packs a new handle and frees the
rest. Packing is most of a CPU swap's pause: 1.8 ms a layer of a 100M model
on one thread, against 0.5 ms to copy it.

``prepare`` runs that same reload (vLLM's own loaders, processing and
packing) on a twin of the model's module tree: new module objects with
parameter and buffer dicts of their own, so nothing the engine reads while
it steps is written, and the work runs on a worker thread while generation
goes on. ``apply``, in the pause, copies the twin's unpacked tensors
(embeddings, norms, biases) into the live ones, which keeps every reference
the engine holds to them valid, and hands the live layers the twin's packed
handles.

Costs one more copy of the model in the worker from staging to the swap:
the new handles are built while the old ones serve. Not for quantized
models, nor GPUs: nothing is packed there, and their pause is the copy from
where the version was staged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
"""A module's own tensor and child registries: a twin gets its own; any other attribute the reload changes
on a twin (its packed GEMM closure ``cpu_linear``) is handed to the live module."""
_ABSENT = object()


def tied_head(model: Any) -> tuple[Any, Any]:
    """The model's (LM head, input embedding), for a model whose config ties them.

    RuntimeError unless the model has exactly one of each: the head is
    re-pointed at the embedding after a reload, and guessing which embedding
    would score with the wrong weights.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embeds = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    if len(heads) != 1 or len(embeds) != 1:
        raise RuntimeError(
            f"a tied LM head needs one embedding and one head to retie; "
            f"{type(model).__name__} has {len(embeds)} embeddings and {len(heads)} heads"
        )
    return heads[0], embeds[0]


EXPERT_WEIGHTS = ("w13_weight", "w2_weight")
"""An MoE layer's expert tensors, [experts, 2 x intermediate, hidden] and [experts, hidden, intermediate], that
vLLM's CPU kernels keep packed."""


def repack_experts(layer: Any) -> bool:
    """Pack a reloaded MoE layer's expert weights into its CPU kernel's layout; whether ``layer`` had any.

    vLLM's unquantized MoE method packs ``w13_weight`` and ``w2_weight`` into
    the CPU kernels' grouped-GEMM layout only the first time it processes a
    layer: ``UnquantizedFusedMoEMethod._setup_kernel`` calls the experts'
    ``process_weights_after_loading`` (the packing) only while the layer has
    no kernel, and on a reload, with the kernel built, copies the new
    weights in as the checkpoint lays them out. The kernel reads them as
    packed, so every MoE layer after a reload computes with neither
    version's experts. This runs the packing the reload skipped, writing
    into the tensors the layer held where their shape allows (a kernel that
    pads the intermediate size makes new ones), and does nothing to a layer
    whose experts pack nothing (zentorch's, a GPU's) or to any other module.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts):
        return False
    held = {name: getattr(layer, name) for name in EXPERT_WEIGHTS}
    experts.process_weights_after_loading(layer)
    for name, old in held.items():
        new = getattr(layer, name)
        if new is not old and new.shape == old.shape and new.dtype == old.dtype:
            old.data.copy_(new.data)
            setattr(layer, name, old)
    return True


def _twin(module: Any, twins: dict[int, Any]) -> Any:
    """A new module object of ``module``'s class with its attributes, its own parameter, buffer and child
    dicts (holding the same tensors), and twins for children; ``twins`` maps id(live) to twin."""
    twin = twins.get(id(module))
    if twin is not None:
        return twin
    twin = module.__class__.__new__(module.__class__)
    state = twin.__dict__
    state.update(module.__dict__)
    state["_parameters"] = dict(module._parameters)
    state["_buffers"] = dict(module._buffers)
    state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    twins[id(module)] = twin
    state["_modules"] = {
        name: None if child is None else _twin(child, twins) for name, child in module._modules.items()
    }
    return twin


def _own_copy(tensor: Any, live: Any, twin: Any) -> Any:
    """An uninitialised tensor shaped like ``tensor`` with its attributes, methods of ``live`` bound to ``twin``.

    For the tensors vLLM's reload loads in place rather than anew (a linear
    layer's bias): loaded into the live one, they would change under the
    running engine.
    """
    import torch

    fresh = torch.empty_strided(tuple(tensor.size()), tuple(tensor.stride()), dtype=tensor.dtype, device=tensor.device)
    fresh.__class__ = tensor.__class__
    fresh.__dict__ = {
        key: value.__func__.__get__(twin) if isinstance(value, MethodType) and value.__self__ is live else value
        for key, value in tensor.__dict__.items()
    }
    return fresh


def _meta_copy(tensor: Any) -> Any:
    """A new meta tensor object like ``tensor`` (a layer's metadata recorded at load time) with a copy of its
    attributes, its weight loader unwrapped from any reload's wrapper.

    vLLM's reload registers the recorded metadata tensors themselves as the
    layer's parameters and wraps their loaders with one bound to that
    layer's bookkeeping. For the live layer that is the same object every
    time; a twin is new each swap, so the twin's must be its own.
    """
    copy = tensor.data.to("meta")
    copy.__class__ = tensor.__class__
    copy.__dict__ = dict(tensor.__dict__)
    loader = copy.__dict__.get("weight_loader")
    while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    if loader is not None:
        copy.__dict__["weight_loader"] = loader
    return copy


@dataclass
class Prepared:
    """A version loaded and packed into a twin of the model, to be handed to the live model in the pause."""

    tensors: list[tuple[Any, Any]] = field(default_factory=list)
    """(live tensor, its new value) for every unpacked tensor the version changes."""
    attributes: list[tuple[Any, str, Any]] = field(default_factory=list)
    """(live module, name, new value): the packed handles' closures, and whatever else the reload set."""
    num_layers: int = 0
    """Modules reloaded."""

    def apply(self) -> None:
        """Make the live model compute with the version (the engine must be paused). Runs once."""
        for live, new in self.tensors:
            live.data.copy_(new)
        for module, name, value in self.attributes:
            setattr(module, name, value)
        self.tensors.clear()
        self.attributes.clear()


def prepare(model: Any, model_config: Any, weights: Iterable[tuple[str, Any]]) -> Prepared:
    """Load ``weights`` (checkpoint names and tensors) into a twin of ``model`` through vLLM's layerwise reload,
    writing nothing the engine reads; RuntimeError naming the layers the version left unloaded.

    Reloads the modules vLLM recorded parameters of at load time, except
    attention layers (their post-load step only resets unquantized KV scales)
    and a tied head, which is re-pointed at the twin's new embedding and
    packed from it; MoE layers' experts are packed after (``repack_experts``).
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    twins: dict[int, Any] = {}
    try:
        return _reload_into_twin(model, model_config, weights, twins)
    finally:
        # The reload's bookkeeping holds each twin through loaders bound to it, and a twin holds the handles it
        # packed; let both go now (the hand-over holds what the pause needs), not at some later collection.
        for twin in twins.values():
            LAYERWISE_INFO.pop(twin, None)
            twin.__dict__.clear()


def _reload_into_twin(
    model: Any, model_config: Any, weights: Iterable[tuple[str, Any]], twins: dict[int, Any]
) -> Prepared:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        finalize_layerwise_reload,
        initialize_online_processing,
    )
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS, restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

    root = _twin(model, twins)
    tie = tied_head(model) if getattr(model_config.hf_text_config, "tie_word_embeddings", False) else None
    names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
    reloaded: list[tuple[Any, Any]] = []
    for live in model.modules():
        info = LAYERWISE_INFO.get(live)
        if info is None or not info.restore_metadata[0] or is_deferred_attention_layer(live):
            continue
        if tie is not None and live is tie[0]:
            continue
        twin = twins[id(live)]
        for registry in (twin._parameters, twin._buffers):
            for name, tensor in registry.items():
                if name in SKIP_TENSORS and tensor is not None:
                    registry[name] = _own_copy(tensor, live, twin)
        params, buffers = info.restore_metadata
        twin_info = LayerReloadingInfo(
            restore_metadata=(
                {name: _meta_copy(t) for name, t in params.items()},
                {name: _meta_copy(t) for name, t in buffers.items()},
            ),
            restore_device=info.restore_device,
        )
        LAYERWISE_INFO[twin] = twin_info
        restore_layer_on_meta(twin, twin_info)
        initialize_online_processing(twin)
        reloaded.append((live, twin))

    root.load_weights(weights)
    # A layer is processed (and its count reset) once all its weights are in; one still waiting got none.
    unloaded = [
        names[id(live)]
        for live, twin in reloaded
        if LAYERWISE_INFO[twin].can_load() and LAYERWISE_INFO[twin].load_numel == 0
    ]
    if unloaded:
        raise RuntimeError(f"the version has no weights for {len(unloaded)} layers: {', '.join(unloaded[:5])}")
    finalize_layerwise_reload(root, model_config)
    for _, twin in reloaded:
        repack_experts(twin)
    if tie is not None:
        head, embed = tie
        twin_head = twins[id(head)]
        twin_head.weight = twins[id(embed)].weight
        twin_head.quant_method.process_weights_after_loading(twin_head)
        reloaded.append((head, twin_head))
    return _handover(reloaded, names)


def _handover(reloaded: list[tuple[Any, Any]], names: dict[int, str]) -> Prepared:
    """What ``apply`` must change on each live module for it to compute as its twin does."""
    prepared = Prepared(num_layers=len(reloaded))
    for live, twin in reloaded:
        for registry in ("_parameters", "_buffers"):
            old_tensors, new_tensors = getattr(live, registry), getattr(twin, registry)
            for name, new in new_tensors.items():
                old = old_tensors.get(name)
                if new is None or old is new:
                    continue
                if old is None or old.shape != new.shape or old.dtype != new.dtype:
                    held = "nothing" if old is None else f"{tuple(old.shape)} {old.dtype}"
                    raise RuntimeError(
                        f"{names[id(live)]}.{name}: the reload made {tuple(new.shape)} {new.dtype}, the engine holds {held}"
                    )
                if new.numel():
                    prepared.tensors.append((old, new))
        for name, value in twin.__dict__.items():
            if name not in MODULE_STATE and live.__dict__.get(name, _ABSENT) is not value:
                prepared.attributes.append((live, name, value))
    return prepared
