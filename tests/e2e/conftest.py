"""Running the local stack inside a test: set up, started, always stopped."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from services.local.config import StackConfig
from services.local.progress import Progress
from services.local.stack import LocalStack

REPO = Path(__file__).resolve().parents[2]

Launch = Callable[..., AbstractContextManager[tuple[LocalStack, Progress]]]


@pytest.fixture
def launch(tmp_path: Path) -> Launch:
    """``with launch(max_steps=..., ...) as (stack, progress):`` a started stack in tmp_path/run.

    ``progress`` is ``stack.progress``; ``stack.follow()`` runs the stack to
    its end. The warm-started model comes from the checkout's cache; on
    leaving the block the stack closes: every process is stopped and the
    summary written. ``eval_rows`` (``eval.jsonl`` rows) are written to the
    run directory before the services start: the fitter loads them as the
    run's curve points and fits them, and skips the run's own eval rounds at
    those versions.
    """

    @contextmanager
    def run(eval_rows: Sequence[Mapping[str, Any]] = (), **overrides: Any) -> Iterator[tuple[LocalStack, Progress]]:
        config = StackConfig(
            **{
                "run_dir": tmp_path / "run",
                "cache_dir": REPO / ".cache" / "asymptote",
                "startup_timeout_s": 240,
                "workload": "arithmetic",  # four-token answers: the quickest runs; words tests say so
                "pin_cores": False,  # the kernel places the processes of stacks run side by side
                **overrides,
            }
        )
        stack = LocalStack(config)
        stack.run_dir.mkdir(parents=True)
        if eval_rows:
            (stack.run_dir / "eval.jsonl").write_text("".join(json.dumps(dict(row)) + "\n" for row in eval_rows))
        with stack:
            stack.start()
            yield stack, stack.progress

    return run
