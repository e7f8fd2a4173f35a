"""Fixtures and hooks shared by every test: the bad-input report is printed here."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from badinput import BAD_INPUTS

# Child processes (subprocess tests, services) inherit this: the test machine
# has few cores shared with other work.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _single_torch_thread() -> Iterator[None]:
    """One intra-op thread for torch, if a collected test module imported it.

    Looks torch up in sys.modules instead of importing it, so the torch-free
    tests stay torch-free (collection has imported every test module by now).
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    yield


SLOW_KINDS = ("e2e", "vllm", "faults")
"""Markers whose tests always start long multi-process work: they belong to the slow tier."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every e2e, vllm and faults test ``slow``, so ``-m "not slow"`` is the fast tier.

    Runs first (before ``-m`` deselects), so the added marker takes part in the selection.
    """
    for item in items:
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


def bad_input_report_path(config: pytest.Config) -> Path:
    """``$ASY_REPORT_DIR/bad-input.json``, by default under ``.pytest-reports/`` in the checkout."""
    directory = os.environ.get("ASY_REPORT_DIR")
    return (Path(directory) if directory else config.rootpath / ".pytest-reports") / "bad-input.json"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The distinct bad inputs the session tried per interface, and the crashes, when it tried any."""
    counts = BAD_INPUTS.counts()
    if not counts:
        return
    total = {
        "distinct": sum(c["distinct"] for c in counts.values()),
        "crashes": sum(c["crashes"] for c in counts.values()),
    }
    path = bad_input_report_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"interfaces": counts, "total": total}, indent=2) + "\n")

    width = max(len("interface"), *map(len, counts))
    terminalreporter.section("bad inputs")
    terminalreporter.write_line(f"{'interface':<{width}}  {'distinct bad inputs':>19}  {'crashes':>7}")
    for name, c in [*counts.items(), ("total", total)]:
        terminalreporter.write_line(f"{name:<{width}}  {c['distinct']:>19}  {c['crashes']:>7}")
    terminalreporter.write_line(f"written to {path}")
