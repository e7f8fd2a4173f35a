"""Rollout routing replay (R3) in a mixture of experts' routers, and the routers' load-balancing loss.

Owns finding an MoE model's routers, making each of them route a token to
the experts the generator recorded for it (R3, arXiv 2510.11370), the
learner's own top-k beside the replayed one (how often they differ is a
step metric), the checks on recorded routing, and the load-balancing loss
the model's own transformers module defines. Nothing here names an
architecture: a router is the ``mlp.gate`` of a decoder layer (transformers
5 puts each MoE layer's router in that module, returning its logits, gate
weights and expert ids), and its gate weights are checked against the
replay's own arithmetic on the first forward.

The replayed gate weights come from the full softmax of the learner's own
router logits, gathered at the recorded experts and renormalised as the
router renormalises its top-k, so the router's weights still get a gradient
through every replayed expert. Gathering from scores already zeroed outside
the learner's own top-k would give a replayed expert the learner did not
pick no weight and no gradient (Megatron-LM fork PR #79).

Routing reaches the routers through the forward's keyword arguments, which
transformers hands to every decoder layer; each decoder layer is wrapped
(before activation checkpointing wraps it) to give its router the layer's
column, so a checkpointed layer's recompute in the backward pass routes to
the same experts as its forward did.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.utils.checkpoint import checkpoint

from asymptote.errors import ModelError, PayloadError

ROUTING_KWARG = "asy_routing"
"""The forward keyword that carries a ``RoutingPass`` down to the decoder layers."""

ROUTING_DTYPES = (torch.uint8, torch.uint16)
"""Expert ids travel in the smallest of these that holds them (as vLLM returns them)."""


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest dtype of ``ROUTING_DTYPES`` that holds the expert ids of ``num_experts`` experts."""
    for dtype in ROUTING_DTYPES:
        if num_experts - 1 <= torch.iinfo(dtype).max:
            return dtype
    raise ValueError(
        f"{num_experts} experts: more than {torch.iinfo(ROUTING_DTYPES[-1]).max + 1} do not fit any routing dtype"
    )


def replayed_gate_weights(logits: torch.Tensor, experts: torch.Tensor, renormalise: bool) -> torch.Tensor:
    """[tokens, k] float32 gate weights of ``experts`` ([tokens, k] ids) from a router's ``logits`` [tokens, experts].

    The full softmax of the logits in float32, gathered at the experts, then
    divided by their sum when the router renormalises its top-k
    (``norm_topk_prob``): with the router's own top-k these are its own gate
    weights, and every gathered weight stays a function of the logits (R3).
    """
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, experts)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


@dataclass(frozen=True)
class MoeLayout:
    """Where an MoE model routes: which decoder layers, over how many experts, to how many each."""

    moe_layers: tuple[int, ...]
    """The decoder layer of each MoE layer, in order: column m of a routing is layer ``moe_layers[m]``."""
    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token goes to in each MoE layer."""


@dataclass
class RoutingPass:
    """One forward's routing, in the order the routers see the tokens, and what the routers report back.

    ``experts`` None: every router picks its own top-k (nothing replayed).
    The per-layer results are assigned, never accumulated, so a checkpointed
    layer's recompute writes what its forward wrote.
    """

    experts: torch.Tensor | None
    """[tokens, MoE layers, k] recorded expert ids (any integer dtype), or None."""
    recorded: torch.Tensor | None
    """[tokens] bool: the tokens that have a recorded routing; the others keep the learner's own."""
    keep_own: bool = False
    """Keep each layer's own top-k (``own``)."""
    own: dict[int, torch.Tensor] = field(default_factory=dict)
    """MoE layer -> [tokens, k] the learner's own top-k (with ``keep_own``)."""
    differing: dict[int, torch.Tensor] = field(default_factory=dict)
    """MoE layer -> recorded tokens whose own top-k is another set of experts than the replayed one."""


@dataclass
class RouterReport:
    """What a caller asks of one forward's routers (``model.PolicyForward``), and what they report back."""

    keep_own: bool = False
    """Report the learner's own top-k (``own``)."""
    load_balancing: bool = False
    """Compute the routers' load-balancing loss (``load_balancing_loss``)."""
    own: torch.Tensor | None = None
    """[rows, tokens, MoE layers, k] the learner's own top-k in the batch's layout (0 on padding)."""
    differing: torch.Tensor | None = None
    """Recorded decisions (a token in one MoE layer) whose own top-k is another set of experts than the replayed."""
    decisions: torch.Tensor | None = None
    """Recorded decisions replayed: tokens with a recorded routing x MoE layers."""
    load_balancing_loss: torch.Tensor | None = None
    """The model's load-balancing loss over the forward's tokens (differentiable)."""


class _Slot:
    """The routing pass a decoder layer's router reads while the layer runs."""

    def __init__(self) -> None:
        self.current: RoutingPass | None = None


class RouterReplay:
    """The replay installed on an MoE model: ``install`` it, then hand a ``RoutingPass`` to each forward
    under ``ROUTING_KWARG`` (``model.PolicyForward`` does)."""

    def __init__(self, layout: MoeLayout, module_name: str) -> None:
        self.layout = layout
        self._module_name = module_name

    @classmethod
    def install(cls, model: torch.nn.Module) -> RouterReplay | None:
        """Wrap ``model``'s decoder layers and hook its routers; None for a model without routers.

        Must come before activation checkpointing wraps the layers (the
        recompute then runs the wrapper too). ModelError when routers
        disagree on the experts or top-k.
        """
        from services.learner.layers import decoder_layers

        layers = decoder_layers(model)
        gates: list[tuple[int, torch.nn.Module]] = []
        for i, layer in enumerate(layers):
            gate = _router(layer)
            if gate is not None:
                gates.append((i, gate))
        if not gates:
            return None
        shapes = {(int(cast(Any, g).num_experts), int(cast(Any, g).top_k)) for _, g in gates}
        if len(shapes) != 1:
            raise ModelError(f"{type(model).__name__}: its routers differ in experts and top-k {sorted(shapes)}")
        ((num_experts, top_k),) = shapes
        layout = MoeLayout(tuple(i for i, _ in gates), num_experts, top_k)
        for i, layer in enumerate(layers):
            forward = layer.forward
            if isinstance(forward, functools.partial) and forward.func is checkpoint:
                raise AssertionError("routing replay must be installed before activation checkpointing")
            slot = _Slot()
            layer.forward = _replaying(forward, slot)  # type: ignore[method-assign]
            gate = _router(layer)
            if gate is not None:
                gate.register_forward_hook(_replay_hook(layout.moe_layers.index(i), slot, gate))
        return cls(layout, type(model).__module__)

    def check(self, routing: torch.Tensor, recorded: torch.Tensor, model_name: str) -> None:
        """PayloadError, one line, when ``routing`` [rows, tokens, MoE layers, k] does not fit this model's routers:
        its shape, its dtype (too small for the experts, or not an integer) or an id beyond the experts."""
        layout = self.layout
        want = (len(layout.moe_layers), layout.top_k)
        if routing.dim() != 4 or tuple(routing.shape[2:]) != want:
            raise PayloadError(
                f"routing of shape {list(routing.shape)} does not fit {model_name}: it takes "
                f"[rows, tokens, {want[0]} MoE layers, top-{want[1]}]"
            )
        check_dtype(routing.dtype, layout.num_experts, model_name)
        ids = routing[recorded.bool()]
        if ids.numel():
            top = int(ids.to(torch.int32).max())
            if top >= layout.num_experts:
                raise PayloadError(
                    f"routing names expert {top}, but {model_name} has {layout.num_experts} experts per MoE layer "
                    f"(ids 0-{layout.num_experts - 1})"
                )

    def load_balancing_loss(
        self, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The model's own load-balancing loss (its transformers module's ``load_balancing_loss_func``, the
        Switch Transformer's, arXiv 2101.03961) over one forward's router logits; the mask leaves padding out.

        It counts the learner's own top-k as the model computes it, not the
        replayed experts: the counts carry no gradient, the router's mean
        probabilities do. ModelError for a model whose module defines none.
        """
        loss_func: Callable[..., torch.Tensor] | None = getattr(
            sys.modules.get(self._module_name), "load_balancing_loss_func", None
        )
        if loss_func is None:
            raise ModelError(f"{self._module_name} defines no load_balancing_loss_func for the router's loss")
        return loss_func(router_logits, self.layout.num_experts, self.layout.top_k, attention_mask)


def check_dtype(dtype: torch.dtype, num_experts: int, model_name: str) -> None:
    """PayloadError when expert ids in ``dtype`` cannot name each of ``num_experts`` experts."""
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise PayloadError(f"routing in {dtype} is not integer expert ids (accepted: uint8, uint16)")
    if torch.iinfo(dtype).max < num_experts - 1:
        raise PayloadError(
            f"routing in {str(dtype).removeprefix('torch.')} holds expert ids up to {torch.iinfo(dtype).max}, "
            f"but {model_name} has {num_experts} experts per MoE layer: send "
            f"{str(routing_dtype(num_experts)).removeprefix('torch.')}"
        )


def _router(layer: torch.nn.Module) -> torch.nn.Module | None:
    """A decoder layer's router: its ``mlp.gate`` when that says how many experts it picks from and picks."""
    try:
        gate = layer.get_submodule("mlp.gate")
    except AttributeError:
        return None
    return gate if hasattr(gate, "top_k") and hasattr(gate, "num_experts") else None


def _replaying(forward: Callable[..., Any], slot: _Slot) -> Callable[..., Any]:
    """A decoder layer's forward that gives its router the routing pass it is handed (and hands it no further)."""

    @functools.wraps(forward)
    def replaying(*args: Any, **kwargs: Any) -> Any:
        slot.current = kwargs.pop(ROUTING_KWARG, None)
        try:
            return forward(*args, **kwargs)
        finally:
            slot.current = None

    return replaying


def _replay_hook(column: int, slot: _Slot, gate: torch.nn.Module) -> Callable[..., Any]:
    """The router's forward hook: the learner's own top-k is kept and compared; the recorded experts replace it."""
    # Mixtral's router renormalises always and has no flag for it; Qwen-MoE's follows norm_topk_prob.
    renormalise = bool(getattr(gate, "norm_topk_prob", True))
    checked = False

    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        nonlocal checked
        routing = slot.current
        if routing is None:
            return None
        logits, scores, own = output
        if not checked:
            _check_gate_weights(module, logits, scores, own, renormalise)
            checked = True
        if routing.keep_own:
            routing.own[column] = own.detach()
        if routing.experts is None or routing.recorded is None:
            return None
        if routing.experts.shape[0] != own.shape[0]:
            raise AssertionError(f"routing for {routing.experts.shape[0]} tokens, the router sees {own.shape[0]}")
        recorded = routing.recorded[:, None]
        experts = torch.where(recorded, routing.experts[:, column].to(own.device, torch.long), own)
        with torch.no_grad():
            other = (experts.sort(dim=-1).values != own.sort(dim=-1).values).any(dim=-1)
            routing.differing[column] = (other & routing.recorded).sum()
        weights = replayed_gate_weights(logits, experts, renormalise)
        return logits, weights.to(scores.dtype), experts

    return hook


def _check_gate_weights(
    gate: torch.nn.Module, logits: torch.Tensor, scores: torch.Tensor, own: torch.Tensor, renormalise: bool
) -> None:
    """ModelError unless the router's own gate weights are ``replayed_gate_weights`` of its own top-k (a router
    that scores otherwise, e.g. by a sigmoid or with a bias, would be replayed wrongly)."""
    with torch.no_grad():
        ours = replayed_gate_weights(logits.detach(), own, renormalise).to(scores.dtype)
        if scores.shape != ours.shape or not torch.allclose(ours, scores.detach(), rtol=1e-2, atol=1e-6):
            raise ModelError(
                f"{type(gate).__name__} does not weigh its experts by the softmax of its logits"
                f"{' renormalised over its top-k' if renormalise else ''}: routing replay cannot reproduce it"
            )
