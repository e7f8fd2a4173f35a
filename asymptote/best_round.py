"""The run's best held-out eval round: which one it is, and where it is kept for the other services.

Owns the rule that picks the best round out of ``eval.jsonl``'s rows (the
fitter's, as it writes them) and the KV entry the fitter publishes it in,
so that the fitter, the learner (which keeps that round's checkpoint) and
``asymptote export --best`` (which reads the run directory) agree on one
round. Knows nothing about checkpoints or fitting.

The best round is the one with the highest held-out pass rate; of equal
ones, the earliest (a later round supersedes only by scoring higher). In a
mixture a version's score is the mean of its sub-tasks' pass rates, and
only versions every sub-task has a row for count. R0's round (version 0)
counts: a run that only got worse has the model it started from as best.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names
from asymptote.messages import decode_best_round

log = logging.getLogger(__name__)


def best_round(rows: Iterable[Mapping[str, Any]]) -> rollout_pb2.BestRound | None:
    """The best of the eval rows (``policy_version``, ``pass_rate`` and, in a mixture, ``task``); None without
    a complete round."""
    by_version: dict[int, dict[str | None, float]] = {}
    tasks: set[str | None] = set()
    for row in rows:
        task = row.get("task")
        tasks.add(task)
        by_version.setdefault(int(row["policy_version"]), {})[task] = float(row["pass_rate"])
    if len(tasks) > 1:
        tasks.discard(None)  # a mixture's rows all name their sub-task
    scores = {
        version: sum(rates[t] for t in tasks) / len(tasks)
        for version, rates in sorted(by_version.items())
        if tasks <= set(rates)
    }
    if not scores:
        return None
    best = max(scores, key=lambda v: (scores[v], -v))
    return rollout_pb2.BestRound(policy_version=best, pass_rate=scores[best], num_rounds=len(scores))


def read_eval_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of an ``eval.jsonl`` that hold a version and a pass rate; a line cut short by a crash is skipped
    (the fitter writes its round again). Empty when the file does not exist."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("policy_version"), int) and "pass_rate" in row:
            rows.append(row)
    return rows


async def publish_best_round(kv: KeyValue, names: Names, best: rollout_pb2.BestRound) -> None:
    best.published_unix_s = time.time()
    await kv.put(names.best_round_key, best.SerializeToString())


async def current_best_round(kv: KeyValue, names: Names) -> rollout_pb2.BestRound | None:
    """The best round the fitter published; None when it has published none. A NATS error propagates: the
    caller cannot tell then whether there is one."""
    try:
        entry = await kv.get(names.best_round_key)
    except KeyNotFoundError:
        return None
    return decode_best_round(entry.value) if entry.value else None
