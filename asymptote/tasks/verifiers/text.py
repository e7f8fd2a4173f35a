"""Verifiers on plain text: exact match, regex match and multiple choice.

Each compares after ``normalize`` and after dropping the ``<think>``
section. Settings models are the config surface; the classes are built by
``asymptote.tasks.verifiers.make_verifier``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from asymptote.config import Frozen
from asymptote.tasks.verifiers.base import CORRECT, NO_ANSWER, PARSE_ERROR, WRONG, Verdict, normalize, strip_think


class ExactSettings(Frozen):
    """The whole answer (after the reasoning section) equals the reference, after normalisation."""

    kind: Literal["exact"] = "exact"
    """Verifier kind."""
    last_line: bool = False
    """Compare only the last non-empty line of the completion (models that explain first)."""


class ExactVerifier:
    def __init__(self, settings: ExactSettings | None = None) -> None:
        self.settings = settings or ExactSettings()

    def check_reference(self, reference: str) -> str:
        ref = normalize(reference)
        if not ref:
            raise ValueError("empty reference")
        return ref

    def verdict(self, completion: str, reference: str) -> Verdict:
        text = strip_think(completion)
        if text is None:
            return NO_ANSWER
        if self.settings.last_line:
            lines = [line for line in text.splitlines() if line.strip()]
            text = lines[-1] if lines else ""
        answer = normalize(text)
        if not answer:
            return NO_ANSWER
        return CORRECT if answer == normalize(reference) else WRONG


class RegexSettings(Frozen):
    """A regex match: with ``pattern``, its last match in the completion is the answer, compared with the
    reference after normalisation; without, the reference is itself a regex the completion must contain."""

    kind: Literal["regex"] = "regex"
    """Verifier kind."""
    pattern: str | None = None
    """Regex whose first group (or whole match, without groups) is the answer, e.g. 'Answer: (\\S+)'; None
    takes each reference as the regex."""
    ignore_case: bool = True
    """Match case-insensitively."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"pattern {value!r} is not a valid regex: {exc}") from None
        return value


class RegexVerifier:
    def __init__(self, settings: RegexSettings | None = None) -> None:
        self.settings = settings or RegexSettings()
        flags = re.IGNORECASE if self.settings.ignore_case else 0
        self._flags = flags
        self._pattern = re.compile(self.settings.pattern, flags) if self.settings.pattern is not None else None

    def check_reference(self, reference: str) -> str:
        if not reference.strip():
            raise ValueError("empty reference")
        if self._pattern is not None:
            return normalize(reference)
        try:
            re.compile(reference, self._flags)
        except re.error as exc:
            raise ValueError(f"reference {reference!r} is not a valid regex: {exc}") from None
        return reference

    def verdict(self, completion: str, reference: str) -> Verdict:
        text = strip_think(completion)
        if text is None:
            return NO_ANSWER
        if self._pattern is None:
            try:
                wanted = re.compile(reference, self._flags)
            except re.error:
                return PARSE_ERROR
            return CORRECT if wanted.search(text) else WRONG
        matches = list(self._pattern.finditer(text))
        if not matches:
            return NO_ANSWER
        last = matches[-1]
        answer = last.group(1) if last.re.groups else last.group(0)
        return CORRECT if normalize(answer or "") == normalize(reference) else WRONG


class ChoiceSettings(Frozen):
    """Multiple choice: the completion's chosen letter equals the reference letter."""

    kind: Literal["choice"] = "choice"
    """Verifier kind."""
    num_choices: int = Field(default=4, ge=2, le=26)
    """Letters allowed: A up to the num_choices-th letter."""


_BOXED_LETTER = re.compile(r"\\boxed\{\s*\(?([A-Za-z])\)?\s*\}")
_STATED_LETTER = re.compile(r"(?:answer|choice|option)\s*(?:is|:)?\s*:?\s*\(?([A-Za-z])\)?(?![A-Za-z])", re.IGNORECASE)
_LONE_LETTER = re.compile(r"^\s*\(?([A-Za-z])\)?[.):]?\s*$")


class ChoiceVerifier:
    """Reads the choice from, in order: the last ``\\boxed{X}``, the last "answer is X", or a completion
    that is a lone letter ("B", "(B)", "B.")."""

    def __init__(self, settings: ChoiceSettings | None = None) -> None:
        self.settings = settings or ChoiceSettings()
        self._letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: self.settings.num_choices]

    def check_reference(self, reference: str) -> str:
        letter = reference.strip().strip("()").upper()
        if len(letter) != 1 or letter not in self._letters:
            raise ValueError(f"reference {reference!r} is not one of the letters {', '.join(self._letters)}")
        return letter

    def verdict(self, completion: str, reference: str) -> Verdict:
        text = strip_think(completion)
        if text is None:
            return NO_ANSWER
        for pattern in (_BOXED_LETTER, _STATED_LETTER, _LONE_LETTER):
            found = pattern.findall(text)
            if found:
                letter = found[-1].upper()
                if letter not in self._letters:
                    return PARSE_ERROR
                return CORRECT if letter == reference.strip().upper() else WRONG
        return NO_ANSWER
