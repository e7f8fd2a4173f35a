"""The eval log: validated records of a run's evaluation passes.

Owns the format of ``eval.jsonl`` as the offline tools read it (one JSON
object per line with at least ``step``, ``policy_version``, ``compute`` in
cumulative accelerator-seconds and ``pass_rate``; other keys are ignored),
the checks a run's records must pass (values in range, compute never
decreasing as the steps grow), and which record is R0. Knows nothing about
fitting; the live fitter writes the file (``collector.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asymptote.errors import AsymptoteError


class EvalFileError(AsymptoteError, ValueError):
    """An eval log or eval row is missing or bad; the message names where and what."""


class EvalRecord(BaseModel):
    """One evaluation pass as written to ``eval.jsonl``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    step: int = Field(ge=0)
    """Learner step the evaluated policy came from."""
    policy_version: int = Field(ge=0)
    """Policy version that was evaluated."""
    compute: float = Field(ge=0.0, allow_inf_nan=False)
    """Cumulative training compute at that version (accelerator-seconds)."""
    pass_rate: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    """Mean pass rate over the held-out prompts and samples."""


def _record(raw: object, where: str) -> EvalRecord:
    if not isinstance(raw, Mapping):
        raise EvalFileError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    try:
        return EvalRecord.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in issue['loc'])}: {issue['msg']}" for issue in error.errors()
        )
        raise EvalFileError(f"{where}: {problems}") from error


def _in_run_order(located: Iterable[tuple[str, EvalRecord]], source: str) -> list[EvalRecord]:
    """Keep the last record of each step, sort by step, and check compute never decreases.

    A repeated step happens when a run resumed from a checkpoint re-evaluates
    the same policy; the later record is the one the run continued from.
    """
    by_step: dict[int, tuple[str, EvalRecord]] = {}
    for where, record in located:
        by_step[record.step] = (where, record)
    if not by_step:
        raise EvalFileError(f"{source}: no evaluation records")
    ordered = [by_step[step] for step in sorted(by_step)]
    for (where_before, before), (where, record) in pairwise(ordered):
        if record.compute < before.compute:
            raise EvalFileError(
                f"{where}: compute {record.compute:g} at step {record.step} is below compute "
                f"{before.compute:g} at step {before.step} ({where_before}); cumulative compute must not "
                "decrease as the steps grow"
            )
    return [record for _, record in ordered]


def read_eval_log(path: Path) -> list[EvalRecord]:
    """Parse an eval log into records in step order; blank lines are skipped.

    Raises EvalFileError naming the file and line of a bad record, or of a
    step whose compute is below an earlier step's.
    """
    located: list[tuple[str, EvalRecord]] = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as error:
                raise EvalFileError(f"{where}: not valid JSON ({error.msg})") from error
            located.append((where, _record(raw, where)))
    return _in_run_order(located, str(path))


def records_from_rows(rows: Sequence[object], source: str = "eval rows") -> list[EvalRecord]:
    """Validate in-memory eval rows (e.g. parsed eval.jsonl lines) into records in step order."""
    return _in_run_order(((f"{source}[{i}]", _record(raw, f"{source}[{i}]")) for i, raw in enumerate(rows)), source)


def split_baseline(records: Sequence[EvalRecord]) -> tuple[EvalRecord, list[EvalRecord]]:
    """R0's record (step 0, else the first) and the curve's records after it, in step order."""
    baseline = next((record for record in records if record.step == 0), records[0])
    return baseline, [record for record in records if record is not baseline]
