"""LoRA settings: one place for the adapter's shape, read by the learner, the generators and the planner.

Owns the ``lora`` settings a run gives once (``asymptote up --lora-rank``,
a stack config's ``lora``, the chart's values), the learning-rate rule
that goes with them, and what a served adapter looks like: its tensors'
names and shapes over a base (``adapter_signature``, peft's file names, in
float32) and its ``adapter_config.json``. Torch-free: the learner builds
peft's ``LoraConfig`` from these (services/learner/adapter.py), the planner
counts the adapter's parameters from them, and the generators size their
engine's LoRA slot by them and check every version against the signature.
Knows nothing about how an adapter is trained or served.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field

from asymptote.codec import Signature
from asymptote.config import Frozen
from asymptote.errors import ConfigError

ALL_LINEAR: Literal["all-linear"] = "all-linear"
"""peft's name for every linear layer of the decoder: not the LM head, not the embeddings."""

FILE_PREFIX = "base_model.model."
"""What peft's ``PeftModel.save_pretrained`` puts before each module name in ``adapter_model.safetensors``."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
SERVED_DTYPE = "float32"
"""An adapter's tensors on the wire and in its file (the engine casts them to its own dtype)."""
_DECODER_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")

LORA_LR_FACTOR = 10.0
"""A LoRA's learning rate over full fine-tuning's: about 10x, the rule of "LoRA Without Regret"
(John Schulman and Thinking Machines Lab, 2025, thinkingmachines.ai/blog/lora), measured with
alpha 32 and the 1/r scaling, across ranks, for supervised and RL fine-tuning."""


class LoraSettings(Frozen):
    """A LoRA adapter trained in place of the whole model: the base frozen, only the adapter learns."""

    rank: int = Field(ge=1, le=1024)
    """r, the adapter's inner dimension (LoRA Without Regret: rank 1 already matches full RL fine-tuning)."""
    alpha: int = Field(default=32, ge=1)
    """The update is scaled by alpha / rank (LoRA Without Regret's 32 keeps the best learning rate
    about the same at every rank)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (0: none, as RL fine-tuning uses)."""
    target_modules: Literal["all-linear"] | tuple[str, ...] = ALL_LINEAR
    """The linear layers that get an adapter, by module name (``q_proj``, ``down_proj``, ...);
    all-linear: every linear layer of the decoder, not the LM head or the embeddings."""

    @property
    def scaling(self) -> float:
        """alpha / rank: what ``B @ A`` is multiplied by before it is added to the base's output."""
        return self.alpha / self.rank


def is_adapter_name(name: str) -> bool:
    """Whether a tensor's name is an adapter's (peft's lora_A / lora_B), not the base's."""
    return ".lora_A." in f".{name}" or ".lora_B." in f".{name}"


def adapter_signature(base: Signature, settings: LoraSettings) -> Signature:
    """The adapter ``settings`` puts over a base of signature ``base`` (its safetensors tensors), as the
    learner serves it: for each adapted linear layer's weight ``<module>.weight`` of shape [out, in],
    ``FILE_PREFIX<module>.lora_A.weight`` [rank, in] and ``.lora_B.weight`` [out, rank], in float32.

    The adapted layers are the decoder layers' linear weights (two-dimensional ``*.weight`` tensors
    inside ``layers.N``) whose module is one of ``target_modules`` (all-linear: every one of them).
    ConfigError naming a target module the base has no such weight of.
    """
    linear = {
        name.removesuffix(".weight"): shape
        for name, (_, shape) in base.items()
        if name.endswith(".weight") and len(shape) == 2 and _DECODER_LAYER.search(name)
    }
    have = sorted({module.rpartition(".")[2] for module in linear})
    targets = settings.target_modules
    if targets != ALL_LINEAR:
        missing = [t for t in targets if t not in have]
        if missing:
            raise ConfigError(
                f"lora.target_modules: the base has no decoder linear layer named {', '.join(missing)}; "
                f"its decoder's are {', '.join(have)} (or all-linear)"
            )
    r = settings.rank
    out: Signature = {}
    for module, (num_out, num_in) in linear.items():
        if targets == ALL_LINEAR or module.rpartition(".")[2] in targets:
            out[f"{FILE_PREFIX}{module}.lora_A.weight"] = (SERVED_DTYPE, (r, num_in))
            out[f"{FILE_PREFIX}{module}.lora_B.weight"] = (SERVED_DTYPE, (num_out, r))
    if not out:
        raise ConfigError("lora: the base has no linear layers inside decoder layers (layers.N) to adapt")
    return out


def adapted_modules(adapter: Signature | dict[str, Any]) -> tuple[str, ...]:
    """The last names of the modules an adapter (its tensors by file name) adapts, sorted: peft's
    ``target_modules`` once all-linear is resolved."""
    return tuple(sorted({name.split(".lora_A.")[0].rpartition(".")[2] for name in adapter if ".lora_A." in name}))


def adapter_config(settings: LoraSettings, adapter: Signature, base_model: str) -> dict[str, Any]:
    """``adapter_config.json`` of an adapter of ``settings`` with the tensors ``adapter``, as peft writes
    it (the fields vLLM's and peft's loaders read); ``base_model``: the base's directory."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": list(adapted_modules(adapter)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": False,
    }
