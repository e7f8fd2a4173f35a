"""The eval log: validated records of a run's evaluation passes.

Owns the format of ``eval.jsonl`` as the offline tools read it (one JSON
object per line with at least ``step``, ``policy_version``, ``compute`` and
``pass_rate``; ``compute_unit`` says what ``compute`` counts, "flops" (the
FLOPs axis) or, in rows that lack it (those written before it),
"device_seconds"; a mixture's rows also name their sub-task in ``task``,
one curve per sub-task; other keys are ignored),
the checks a run's records must pass (values in range, compute never
decreasing as the steps grow, one unit throughout), and which record is R0.
Knows nothing about fitting; the live fitter writes the file
(``collector.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asymptote.compute import ComputeUnit
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
    """Cumulative training compute at that version, in ``compute_unit``."""
    compute_unit: ComputeUnit = "device_seconds"
    """What ``compute`` counts: FLOPs, or device-seconds held (rows written before the FLOPs axis)."""
    pass_rate: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    """Mean pass rate over the held-out prompts and samples."""
    task: str | None = None
    """The mixture's sub-task the record is of; None in a single-task run."""


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
    first_where, first = ordered[0]
    for where, record in ordered[1:]:
        if record.compute_unit != first.compute_unit:
            raise EvalFileError(
                f"{where}: compute in {record.compute_unit} where {first_where} has it in {first.compute_unit}; "
                "one curve has one compute axis"
            )
    for (where_before, before), (where, record) in pairwise(ordered):
        if record.compute < before.compute:
            raise EvalFileError(
                f"{where}: compute {record.compute:g} at step {record.step} is below compute "
                f"{before.compute:g} at step {before.step} ({where_before}); cumulative compute must not "
                "decrease as the steps grow"
            )
    return [record for _, record in ordered]


def eval_log_tasks(path: Path) -> list[str]:
    """The sub-tasks an eval log has rows of, in order of first appearance; empty for a single-task log."""
    found: dict[str, None] = {}
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                raw = json.loads(line)
            except json.JSONDecodeError:
                continue  # read_eval_log names it
            if isinstance(raw, Mapping) and isinstance(raw.get("task"), str):
                found[raw["task"]] = None
    return list(found)


def read_eval_log(path: Path, task: str | None = None) -> list[EvalRecord]:
    """Parse an eval log into records in step order; blank lines are skipped. With ``task``, only that
    sub-task's records (a mixture's log); without, those that name no sub-task (a single-task log's).

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
            record = _record(raw, where)
            if record.task == task:
                located.append((where, record))
    return _in_run_order(located, f"{path} (sub-task {task})" if task else str(path))


def records_from_rows(rows: Sequence[object], source: str = "eval rows") -> list[EvalRecord]:
    """Validate in-memory eval rows (e.g. parsed eval.jsonl lines) into records in step order."""
    return _in_run_order(((f"{source}[{i}]", _record(raw, f"{source}[{i}]")) for i, raw in enumerate(rows)), source)


def split_baseline(records: Sequence[EvalRecord]) -> tuple[EvalRecord, list[EvalRecord]]:
    """R0's record (step 0, else the first) and the curve's records after it, in step order."""
    baseline = next((record for record in records if record.step == 0), records[0])
    return baseline, [record for record in records if record is not baseline]
