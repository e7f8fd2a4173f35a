"""What a verifier is: a check of one completion against one reference.

Owns the ``Verdict`` record, the ``Verifier`` protocol, the reasons a verdict
can carry, and the text clean-up every built-in verifier starts with
(``strip_think``, ``normalize``). Knows nothing about processes or time
limits (pool.py) nor where references come from (the dataset task).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Reason = Literal["correct", "wrong", "no_answer", "parse_error", "timeout", "error"]
"""Why a completion got its reward: counted by the scoring pool for metrics."""
REASONS: tuple[Reason, ...] = ("correct", "wrong", "no_answer", "parse_error", "timeout", "error")


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a completion is correct, and why."""

    correct: bool
    reason: Reason


CORRECT = Verdict(True, "correct")
WRONG = Verdict(False, "wrong")
NO_ANSWER = Verdict(False, "no_answer")
PARSE_ERROR = Verdict(False, "parse_error")


@runtime_checkable
class Verifier(Protocol):
    """Checks completions against references; plugins implement the same two methods."""

    def check_reference(self, reference: str) -> str:
        """The reference as the verifier will compare it; ValueError if it cannot be used."""
        ...

    def verdict(self, completion: str, reference: str) -> Verdict:
        """Judge ``completion`` against a reference returned by ``check_reference``; never raises."""
        ...


THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def strip_think(text: str) -> str | None:
    """The text after the reasoning section, or None when reasoning never ended.

    Everything up to the last ``</think>`` is dropped (a chat template may
    put the opening tag in the prompt, so the closing tag alone counts). A
    ``<think>`` with no closing tag after it means the completion was cut
    while reasoning: it has no answer.
    """
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        return text[close + len(THINK_CLOSE) :]
    if THINK_OPEN in text:
        return None
    return text


_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Case-folded, NFKC, whitespace collapsed, outer punctuation and spaces trimmed."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = _SPACE.sub(" ", text)
    return text.strip(" \t\n.,;:!?\"'`")
