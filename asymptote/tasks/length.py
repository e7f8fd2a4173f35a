"""Interruption length control's settings and budget draw (ScaleRL, torch-free).

ScaleRL (Khatri et al., 2025, https://arxiv.org/abs/2510.13786) bounds a
reasoning completion by interruption rather than by plain truncation: a
completion that reaches its thinking budget without closing its thinking
gets a fixed "time is up" phrase appended, then continues for at most an
answer budget. The generator carries this out (services/generator/length.py);
this module owns what is configured and how a budget is drawn.
"""

from __future__ import annotations

import hashlib
import random

from pydantic import Field, model_validator

from asymptote.config import Frozen

SCALERL_PHRASE = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
"""ScaleRL's interruption phrase (its closing tag ends the thinking)."""


class LengthControlSettings(Frozen):
    """Interruption length control; off while ``thinking_budget_tokens`` is None."""

    thinking_budget_tokens: tuple[int, int] | None = None
    """[low, high]: each prompt group's thinking budget is drawn uniformly from this range (inclusive);
    None turns length control off (completions run to the task's max_tokens)."""
    answer_budget_tokens: int = Field(default=512, ge=1)
    """Tokens a completion may add once its thinking is closed (by itself or by the phrase)."""
    interruption_phrase: str = SCALERL_PHRASE
    """Appended to a completion that reaches its thinking budget still thinking; kept out of the loss."""
    think_end: str = "</think>"
    """The text that closes a completion's thinking."""
    seed: int = 0
    """Seed of the budget draw (with the task id, so a redelivered task draws the same budget)."""

    @model_validator(mode="after")
    def _check(self) -> LengthControlSettings:
        budget = self.thinking_budget_tokens
        if budget is not None and not 1 <= budget[0] <= budget[1]:
            raise ValueError(f"thinking_budget_tokens must be [low, high] with 1 <= low <= high, got {list(budget)}")
        if not self.think_end:
            raise ValueError("think_end must not be empty")
        if budget is not None and not self.interruption_phrase.strip():
            raise ValueError("interruption_phrase must not be empty")
        return self

    @property
    def enabled(self) -> bool:
        return self.thinking_budget_tokens is not None


def draw_thinking_budget(settings: LengthControlSettings, task_id: str) -> int:
    """The thinking budget of one prompt group: uniform over the configured range, fixed by seed and task id.

    One budget per group, so the G completions that the advantage compares
    ran under the same limit; the same task drawn again (a redelivery) gets
    the same budget. ValueError when length control is off.
    """
    if settings.thinking_budget_tokens is None:
        raise ValueError("length control is off: no thinking_budget_tokens to draw from")
    low, high = settings.thinking_budget_tokens
    key = hashlib.blake2b(f"{settings.seed}:{task_id}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(key, "big")).randint(low, high)
