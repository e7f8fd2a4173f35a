"""A LoRA adapter on the learner's policy: peft's layers in the model, the base frozen, the adapter trained.

Owns putting peft's LoRA layers into a causal LM (``add_adapter``, before
the model is sharded or allocated), the check that every target module is
one of the model's linear layers, the base's dtype (the body's compute dtype
for the frozen decoder layers: bf16 on GPUs; the embeddings, the final norm
and the LM head stay float32, so the FP32 head reads the weight it always
read), the adapter's initialisation (peft's: A as a linear layer's, B zero),
the adapter's tensors under peft's file names (what ``adapter_model.safetensors``
holds and what generators load), ``adapter_config.json``, and merging an
adapter into base weights (``W + scaling * B @ A`` in float32). The base
gets no float32 copy, no gradient and no AdamW state: only the adapter's
parameters require a gradient, and the trainer's optimizer takes only those.
Knows nothing about losses, checkpoints' files or serving.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from asymptote.codec import hasher, safetensors_files
from asymptote.errors import ConfigError
from asymptote.lora import (
    ADAPTER_CONFIG,
    ALL_LINEAR,
    FILE_PREFIX,
    LoraSettings,
    adapted_modules,
    is_adapter_name,
)
from services.learner.layers import decoder_layers
from services.learner.model import Precision

ADAPTER = "default"
"""peft's name for the one adapter a model holds here."""


def peft_config(settings: LoraSettings, base_model: str | None = None) -> Any:
    """peft's ``LoraConfig`` of ``settings`` (a causal LM's; ``base_model``: its directory, for the file)."""
    from peft import LoraConfig

    targets = settings.target_modules
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets if targets == ALL_LINEAR else list(targets),
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last names of the model's linear layers inside its decoder (what ``target_modules`` may name)."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    return sorted(
        {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    )


def check_targets(model: torch.nn.Module, settings: LoraSettings) -> None:
    """ConfigError in one line naming a target module the model has no linear layer of, and those it has."""
    if settings.target_modules == ALL_LINEAR:
        return
    have = linear_names(model)
    missing = [t for t in settings.target_modules if t not in have]
    if missing:
        raise ConfigError(
            f"lora.target_modules: {type(model).__name__} has no linear layer named {', '.join(missing)}; "
            f"its decoder's are {', '.join(have)} (or all-linear)"
        )


def add_adapter(model: torch.nn.Module, settings: LoraSettings, precision: Precision) -> None:
    """peft's LoRA layers into ``model`` in place, the base frozen and its decoder layers in the compute dtype.

    Call before the model is sharded or allocated (on the meta device nothing
    is allocated). ``initialize`` gives the adapter its starting values once
    the model is allocated.
    """
    from peft import inject_adapter_in_model

    check_targets(model, settings)
    inject_adapter_in_model(peft_config(settings), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    # The frozen decoder layers hold the compute dtype (bf16 on GPUs): no float32 copy of the base. The
    # root's tensors (embeddings, final norm, LM head) stay float32, as the FP32 head reads them.
    dtype = precision.compute_dtype
    for layer in decoder_layers(model):
        for module in layer.modules():
            for key, param in list(module.named_parameters(recurse=False)):
                if not is_adapter(key) and param.dtype != dtype:
                    module.register_parameter(key, torch.nn.Parameter(param.to(dtype), requires_grad=False))


def is_adapter(name: str) -> bool:
    """Whether a parameter's name is an adapter's (peft's lora_A / lora_B), not the base's."""
    return is_adapter_name(name)


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds peft's LoRA layers."""
    return any(is_adapter(name) for name, _ in model.named_parameters())


@torch.no_grad()
def initialize(model: torch.nn.Module, seed: int = 0) -> None:
    """The adapter's starting values, as peft gives them: A as a linear layer's default (Kaiming-uniform), B
    zero (the policy starts as the base).

    Drawn whole from a generator seeded by ``seed`` and then cut to each rank's
    shard, so one rank, DDP replicas and FSDP2 shards start from the same
    adapter (a sharded draw would give each shard values of its own).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        whole = torch.zeros(param.shape, dtype=torch.float32)
        if ".lora_A." in name:
            torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
        if isinstance(param, DTensor):  # this rank's shard of the whole, cut locally
            whole = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(whole.to(device=param.device, dtype=param.dtype))


def file_names(model: torch.nn.Module) -> dict[str, str]:
    """Each adapter tensor's name in peft's adapter file -> its name in ``model``'s state dict."""
    out = {}
    for name in model.state_dict():
        if is_adapter(name):
            out[file_name(name)] = name
    return out


def file_name(state_name: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.default.weight`` -> peft's file name for it."""
    return FILE_PREFIX + state_name.replace(f".{ADAPTER}.", ".")


def write_config(settings: LoraSettings, base_model: str, adapter: Mapping[str, torch.Tensor], out: Path) -> None:
    """``adapter_config.json`` of ``settings`` into ``out``, as peft writes it, with the modules ``adapter``
    (its tensors by file name) adapts named (as peft names them once all-linear is resolved)."""
    resolved = settings.model_copy(update={"target_modules": adapted_modules(dict(adapter))})
    peft_config(resolved, base_model).save_pretrained(str(out))


def read_config(adapter_dir: Path) -> dict[str, Any]:
    """An adapter directory's ``adapter_config.json``."""
    data: dict[str, Any] = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    return data


def merged(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, dtype: torch.dtype
) -> torch.Tensor:
    """``W + scaling * B @ A`` computed in float32, then cast to ``dtype``: the update is added before any
    rounding (merging into bf16 first would round a small update away)."""
    update = lora_b.to(torch.float32) @ lora_a.to(torch.float32)
    return (weight.to(torch.float32) + scaling * update).to(dtype)


def base_layer_names(adapter: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """The base weights an adapter changes: model weight name -> (lora_A file name, lora_B file name)."""
    out = {}
    for name in adapter:
        if ".lora_A." in name:
            module = name.removeprefix(FILE_PREFIX).split(".lora_A.")[0]
            out[f"{module}.weight"] = (name, name.replace(".lora_A.", ".lora_B."))
    return out


def base_digest(model_dir: Path) -> str:
    """The base model's content digest (BLAKE3 over its safetensors files, in name order): what a LoRA
    checkpoint records, so that it is resumed and exported over the same base only."""
    digest = hasher()
    for path in safetensors_files(model_dir):
        digest.update(path.name.encode())
        digest.update_mmap(str(path))
    return str(digest.hexdigest())
