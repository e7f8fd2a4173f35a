"""LoRA settings: one place for the adapter's shape, read by the learner, the generators and the planner.

Owns the ``lora`` settings a run gives once (``asymptote up --lora-rank``,
a stack config's ``lora``, the chart's values) and the learning-rate rule
that goes with them. Torch-free: the learner builds peft's ``LoraConfig``
from these (services/learner/adapter.py), the planner counts the adapter's
parameters from them, and the generators size their engine's LoRA slots by
them. Knows nothing about how an adapter is trained or served.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asymptote.config import Frozen

ALL_LINEAR: Literal["all-linear"] = "all-linear"
"""peft's name for every linear layer of the decoder: not the LM head, not the embeddings."""

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
