"""A model's decoder layers, as transformers names them: what sharding, activation checkpointing, LoRA and
routing replay each wrap or walk. Knows nothing about any of them."""

from __future__ import annotations

import torch

from asymptote.errors import ModelError


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the outermost modules of the classes in its ``_no_split_modules``.

    ModelError when the model lists none or none of them is in it.
    """
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    if not kinds:
        raise ModelError(
            f"{type(model).__name__} lists no _no_split_modules, so its decoder layers cannot be found "
            "(needed for FSDP2 and activation checkpointing)"
        )
    layers: list[torch.nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ in kinds and not any(name.startswith(outer + ".") for outer in inside):
            layers.append(module)
            inside.append(name)
    if not layers:
        raise ModelError(f"{type(model).__name__} has no module of its _no_split_modules {sorted(kinds)}")
    return layers
