"""Math answers through the ``math-verify`` library.

The reasoning section is dropped first (``strip_think``); the answer is the
last ``\\boxed{...}`` of what remains (or, with ``require_boxed`` off,
whatever math-verify's extraction finds), and it counts as correct when
math-verify finds it equivalent to the reference: LaTeX and plain forms,
fractions and decimals, sets and intervals. Time limits are the scoring
pool's job (pool.py): math-verify's own signal-based timeouts are off, so
this runs in any thread.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import Field

from asymptote.config import Frozen
from asymptote.tasks.verifiers.base import CORRECT, NO_ANSWER, PARSE_ERROR, WRONG, Verdict, strip_think


class MathSettings(Frozen):
    """Equivalence of math answers (math-verify)."""

    kind: Literal["math"] = "math"
    """Verifier kind."""
    require_boxed: bool = True
    """Only a \\boxed{} answer counts; off, math-verify also reads unboxed final answers."""
    float_rounding: int = Field(default=6, ge=0, le=15)
    """Decimal places numbers are rounded to before comparing."""


BOXED = "\\boxed"


@functools.cache
def _math_verify() -> None:
    """Import math-verify with its "Timeout is disabled" warnings already given: its time limits are off on
    purpose (the scoring pool's kill is the limit), and its parser and its grader would each warn once."""
    from math_verify import grader, parser

    parser.TIMEOUT_WARNING_SHOWN = True
    grader.TIMEOUT_WARNING_SHOWN = True


@functools.lru_cache(maxsize=4096)
def _parse_reference(reference: str) -> tuple[Any, ...]:
    _math_verify()
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    # A reference is usually bare ("42", "\\frac{1}{2}"): read as inline LaTeX
    # first, then as it is (plain expressions such as "1/2" or "3.5").
    for text in (f"${reference}$", reference):
        found = parse(text, extraction_config=configs, fallback_mode="no_fallback", parsing_timeout=None)
        if found:
            return tuple(found)
    return ()


class MathVerifier:
    def __init__(self, settings: MathSettings | None = None) -> None:
        self.settings = settings or MathSettings()

    def check_reference(self, reference: str) -> str:
        ref = reference.strip()
        if not ref:
            raise ValueError("empty reference")
        if not _parse_reference(ref):
            raise ValueError(f"math-verify cannot parse the reference {ref[:80]!r}")
        return ref

    def verdict(self, completion: str, reference: str) -> Verdict:
        _math_verify()
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        text = strip_think(completion)
        if text is None:
            return NO_ANSWER
        if self.settings.require_boxed:
            if BOXED not in text:
                return NO_ANSWER
            configs: list[Any] = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
        else:
            configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
        gold = _parse_reference(reference.strip())
        if not gold:
            return PARSE_ERROR
        try:
            answer = parse(text, extraction_config=configs, parsing_timeout=None)
        except Exception:  # math-verify raises only with raise_on_error, but sympy can still escape
            return PARSE_ERROR
        if not answer:
            return PARSE_ERROR if self.settings.require_boxed else NO_ANSWER
        try:
            ok = verify(list(gold), answer, float_rounding=self.settings.float_rounding, timeout_seconds=None)
        except Exception:
            return PARSE_ERROR
        return CORRECT if ok else WRONG
