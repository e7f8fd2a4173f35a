"""Running the local stack inside a test: set up, started, always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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

    The warm-started model comes from the checkout's cache; on leaving the
    block every process is stopped and the summary written.
    """

    @contextmanager
    def run(**overrides: Any) -> Iterator[tuple[LocalStack, Progress]]:
        config = StackConfig(
            **{
                "run_dir": tmp_path / "run",
                "cache_dir": REPO / ".cache" / "asymptote",
                "startup_timeout_s": 240,
                **overrides,
            }
        )
        stack = LocalStack(config)
        stack.run_dir.mkdir(parents=True)
        model_dir = stack.prepare_model()
        progress = Progress(stack.run_dir, config.max_steps)
        try:
            stack.start_nats()
            stack.start_services(stack.write_configs(model_dir))
            yield stack, progress
        finally:
            stack.stop()
            progress.finish(stack)

    return run
