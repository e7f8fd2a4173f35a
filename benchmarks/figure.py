"""One typed record per benchmark figure: what ``bench.json``, ``bench.md`` and the tests read.

Owns the record and its verdict: a figure that ran meets all its targets or
misses; one that was not run has no verdict. Knows nothing about how any
figure is measured.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Direction = Literal["at least", "at most", "under"]
_SYMBOL: dict[str, str] = {"at least": ">=", "at most": "<=", "under": "<"}


def quantity(x: float | None, unit: str) -> str:
    """``x`` for a reader: seconds under one as milliseconds, a ratio as ``1.23x``, "-" if unknown."""
    if x is None or not math.isfinite(x):
        return "-"
    if unit == "s":
        return f"{x * 1e3:.1f} ms" if abs(x) < 1 else f"{x:.2f} s"
    if unit == "x":
        return f"{x:.2f}x"
    return f"{x:,.0f} {unit}" if abs(x) >= 100 else f"{x:.3g} {unit}"


class Target(BaseModel):
    """A bound on a figure's ``value`` (in its unit) or on its ``ratio`` (a plain factor)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    of: Literal["value", "ratio"]
    direction: Direction
    bound: float
    rule: str = ""
    """How ``bound`` follows from the baseline when it is not a constant, e.g. "2 x copy + 20 ms"."""

    def met_by(self, x: float) -> bool:
        if self.direction == "at least":
            return x >= self.bound
        return x <= self.bound if self.direction == "at most" else x < self.bound

    def describe(self, unit: str) -> str:
        bound = quantity(self.bound, unit) if self.of == "value" else f"{self.bound:g}"
        return f"{_SYMBOL[self.direction]} {bound}" + (f" ({self.rule})" if self.rule else "")


class Figure(BaseModel):
    """One performance figure: a value measured against a baseline from the same invocation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    value: float | None
    """The measured quantity in ``unit``; None when it was not run or could not be measured."""
    unit: str
    """Its unit: s, tokens/s, groups/s, samples/s, ..."""
    ratio: float | None = None
    """The value against the baseline, as its targets read it (e.g. service step / bare step)."""
    baseline: str
    """What the value is compared with, with its number."""
    measured: str
    """What was measured, in words, with its number and sample size."""
    targets: tuple[Target, ...]
    not_run: str | None = None
    """Why the figure was not run; None when it was."""
    details: dict[str, Any] = Field(default_factory=dict)
    """Every number behind the figure, for whoever checks it."""

    @property
    def target(self) -> str:
        return " and ".join(t.describe(self.unit) for t in self.targets)

    @property
    def met(self) -> bool | None:
        """None when not run; False when a number a target reads is missing or not finite."""
        if self.not_run is not None:
            return None
        numbers = {"value": self.value, "ratio": self.ratio}
        return all((x := numbers[t.of]) is not None and math.isfinite(x) and t.met_by(x) for t in self.targets)

    @property
    def verdict(self) -> str:
        return {True: "met", False: "MISSED", None: "not run"}[self.met]

    def as_json(self) -> dict[str, Any]:
        """The record as bench.json holds it: its fields plus ``target`` and ``met`` in words and as a verdict."""
        return {**self.model_dump(mode="json"), "target": self.target, "met": self.met}


def not_run(name: str, unit: str, targets: tuple[Target, ...], why: str) -> Figure:
    return Figure(
        name=name, value=None, unit=unit, baseline="-", measured=f"not run: {why}", targets=targets, not_run=why
    )


def write_and_print(figures: list[Figure], path: Path) -> None:
    """Write ``figures`` to ``path`` (a JSON list) and print a line for each: value, ratio, target, verdict."""
    from rich.console import Console

    path.write_text(json.dumps([f.as_json() for f in figures], indent=2) + "\n")
    console = Console()
    for f in figures:
        ratio = "no ratio" if f.ratio is None else f"{f.ratio:.2f}x"
        console.print(f"{f.name}: {quantity(f.value, f.unit)}, {ratio} {f.baseline} (target {f.target}: {f.verdict})")
