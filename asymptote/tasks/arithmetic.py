"""Multi-digit arithmetic: the built-in verifiable task of the embedded default.

Owns the problem generator (deterministic by seed, disjoint train and
held-out splits) and the exact-match verifier. Knows nothing about
tokenizers or models: a prompt is plain text such as ``"37+485="`` and a
completion is the text the policy wrote after it.

Defaults shape the problems for a tiny model trained briefly:
``pad_operands`` zero-pads operands to ``max_digits`` (``"037+485="``), so
digits of equal weight sit at fixed offsets from each other and from ``=``;
``reverse_answer`` writes the reference least significant digit first
(``"037+485="`` -> ``"225"``), so a left-to-right decoder produces each digit
from two operand digits plus the carry it has just written. Written the usual
way, the first digit depends on every carry below it, and a model of a few
hundred thousand parameters needs far more than a short supervised pass.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from asymptote.config import Frozen
from asymptote.tasks.base import Problem, Split

log = logging.getLogger(__name__)

Operation = Literal["+", "-"]

# Every character a prompt or a reference can contain, whatever the settings,
# so one tokenizer serves every variant of the task.
ALPHABET = "0123456789+-="


class ArithmeticSettings(Frozen):
    """Parameters of the arithmetic task; two equal settings give equal splits."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    name: Literal["arithmetic"] = "arithmetic"
    """Task kind (discriminator when more tasks exist)."""
    min_digits: int = Field(default=1, ge=1, le=9)
    """Fewest digits of an operand."""
    max_digits: int = Field(default=3, ge=1, le=9)
    """Most digits of an operand; each operand's digit count is uniform in [min, max]."""
    operations: tuple[Operation, ...] = ("+",)
    """Operations drawn uniformly; "-" puts the larger operand first (no negatives)."""
    reverse_answer: bool = True
    """Reference written least significant digit first (see module docstring)."""
    pad_operands: bool = True
    """Operands zero-padded to max_digits ("007+485="), so digits of equal weight align."""
    num_train: int = Field(default=20_000, ge=1)
    """Problems in the train split (fewer if the problem space is smaller)."""
    num_heldout: int = Field(default=200, ge=1)
    """Problems in the held-out split, drawn first and never in train."""
    seed: int = 0
    """Seed of the problem generator."""

    @model_validator(mode="after")
    def _check(self) -> ArithmeticSettings:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must be <= max_digits ({self.max_digits})")
        if not self.operations:
            raise ValueError("operations must name at least one of '+', '-'")
        return self


class ArithmeticTask:
    """Exact-answer arithmetic problems and their verifier."""

    name: str

    def __init__(self, settings: ArithmeticSettings | None = None) -> None:
        self.settings = settings or ArithmeticSettings()
        self.name = self.settings.name
        self._splits: dict[Split, tuple[Problem, ...]] | None = None

    def problems(self, split: Split) -> Sequence[Problem]:
        """The problems of ``split`` ("train" or "heldout"), in a fixed order."""
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        if self._splits is None:
            self._splits = self._generate()
        return self._splits[split]

    def score(self, completion_text: str, reference: str) -> float:
        """1.0 if the completion is exactly the reference (outer whitespace ignored), else 0.0."""
        if not isinstance(completion_text, str) or not isinstance(reference, str):
            return 0.0
        return 1.0 if completion_text.strip() == reference.strip() else 0.0

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.settings.min_digits, self.settings.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = self._operand(rng), self._operand(rng)
        op = rng.choice(self.settings.operations)
        if op == "-":
            a, b = max(a, b), min(a, b)
            value = a - b
        else:
            value = a + b
        answer = str(value)
        if self.settings.reverse_answer:
            answer = answer[::-1]
        if self.settings.pad_operands:
            width = self.settings.max_digits
            return f"{a:0{width}d}{op}{b:0{width}d}=", answer
        return f"{a}{op}{b}=", answer

    def _space_size(self) -> int:
        per_operand = sum(
            10 if d == 1 else 9 * 10 ** (d - 1) for d in range(self.settings.min_digits, self.settings.max_digits + 1)
        )
        return per_operand * per_operand * len(set(self.settings.operations))

    def _generate(self) -> dict[Split, tuple[Problem, ...]]:
        s = self.settings
        space = self._space_size()
        if s.num_heldout >= space:
            raise ValueError(f"num_heldout={s.num_heldout} leaves no train problems (only {space} exist)")
        rng = random.Random(s.seed)
        seen: set[str] = set()
        splits: dict[Split, list[Problem]] = {"heldout": [], "train": []}
        # Held-out first so that growing num_train never changes the held-out set.
        targets: list[tuple[Split, int]] = [
            ("heldout", s.num_heldout),
            ("train", min(s.num_train, space - s.num_heldout)),
        ]
        for split, target in targets:
            # Rejection sampling slows down as the space fills; the bound keeps
            # a tiny space (tests) from looping forever and is far above what
            # the default space needs.
            attempts = 0
            while len(splits[split]) < target and attempts < 50 * target + 10_000:
                attempts += 1
                prompt, answer = self._draw(rng)
                if prompt in seen:
                    continue
                seen.add(prompt)
                splits[split].append(Problem(prompt_id=_prompt_id(prompt), prompt=prompt, reference=answer))
        if len(splits["train"]) < s.num_train:
            log.info("arithmetic: train split holds %d problems (asked %d)", len(splits["train"]), s.num_train)
        return {split: tuple(items) for split, items in splits.items()}


def _prompt_id(prompt: str) -> str:
    # Content-addressed so curriculum state survives a change of split sizes;
    # hex only, so the id is safe in NATS subjects and file names.
    return "arith-" + hashlib.blake2b(prompt.encode(), digest_size=8).hexdigest()
