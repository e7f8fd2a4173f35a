"""What every task provides: problems in two splits and a verifier.

Owns the ``Problem`` record and the ``Task`` protocol; concrete tasks live in
their own modules and are looked up through ``asymptote.tasks.get_task``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Split = Literal["train", "heldout"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt with the reference answer its verifier checks against."""

    prompt_id: str
    """Stable id, unique within the task (safe in NATS subjects and file names)."""
    prompt: str
    """Text the policy continues."""
    reference: str
    """What the verifier compares the completion with."""


@runtime_checkable
class Task(Protocol):
    """A verifiable task: deterministic problems and a reward function."""

    name: str
    """Registry name of the task."""

    def problems(self, split: Split) -> Sequence[Problem]:
        """The problems of ``split``; the same settings give the same sequence."""
        ...

    def score(self, completion_text: str, reference: str) -> float:
        """Reward of a completion in [0, 1]; never raises on malformed text."""
        ...
