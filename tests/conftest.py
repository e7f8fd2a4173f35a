"""Fixtures and hooks shared by every test: the bad-input report is printed here."""

from __future__ import annotations

# isort: off
# First: importing asymptote turns gRPC's fork handlers off (asymptote/__init__.py), which gRPC reads
# once, when it is imported (badinput, below, imports it).
import asymptote  # noqa: F401
# isort: on

import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.badinput import BAD_INPUTS

# Child processes (subprocess tests, services) inherit this: the test machine
# has few cores shared with other work.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vLLM's CPU worker binds its OpenMP threads to the first core ("auto"), so every engine of the suite's
# parallel workers would share core 0 while the other waits: the kernel places them instead.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM stops the run as Ctrl-C does: fixtures tear down, so the servers they started stop.

    Python's default for SIGTERM ends the process at once, skipping every
    teardown; the servers a session fixture started (nats-server) would stay.
    Those are also started with ``asymptote.lifecycle.die_with_parent``, for a
    SIGKILL no handler sees.
    """
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    # One interrupt: the teardown it starts runs to its end. A Python-level no-op, not SIG_IGN,
    # which processes started during the teardown would inherit.
    signal.signal(signal.SIGTERM, lambda *_: None)
    raise KeyboardInterrupt(signal.Signals(signum).name)


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


def cost_rank(item: pytest.Item) -> int:
    """Where a test's module goes in the run, the longest kinds of work first (0)."""
    for rank, kind in enumerate(("faults", "e2e", "vllm", "slow")):
        if item.get_closest_marker(kind):
            return rank
    return len(SLOW_KINDS) + 1


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every e2e, vllm and faults test ``slow``, so ``-m "not slow"`` is the fast tier;
    order modules longest kind first, and keep each module on one parallel worker.

    Runs first (before ``-m`` deselects), so the added marker takes part in the selection.
    With pytest-xdist (``scripts/test.sh`` runs ``-n 2 --dist loadscope``) a worker takes a
    whole module, so its module-scoped fixtures (a vLLM engine, a nats-server) start once;
    the modules go out in this order (``--no-loadscope-reorder``), so the longest start
    first and the short ones fill in around them.
    """
    for item in items:
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    module_rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        module_rank[module] = min(module_rank.get(module, cost_rank(item)), cost_rank(item))
    items.sort(key=lambda item: module_rank[item.nodeid.split("::")[0]])  # stable: file order within a rank


SHARED_WORKER = {"tests/integration/test_multiturn_rollout.py": "tests/generator/test_episodes.py"}
"""Modules sent to the parallel worker of another module: they share a session fixture that starts a
vLLM engine (``qwen3_chat_engine``), which then starts once (a worker takes whole modules)."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's ``loadscope`` (a module to one worker), with SHARED_WORKER's modules put together."""
    if config.getvalue("dist") != "loadscope":
        return None  # xdist's own scheduler for the mode asked for
    from xdist.scheduler import LoadScopeScheduling

    class SharedWorkerScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SHARED_WORKER.get(scope, scope)

    return SharedWorkerScheduling(config, log)


@pytest.fixture(scope="session")
async def qwen3_chat_engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Path, Any]]:
    """The tiny Qwen3 chat model (tool-calling template, tests/envs/chat_models.py) and one vLLM engine
    serving it, for the modules that play episodes on it (see SHARED_WORKER). Nothing swaps its weights."""
    from services.generator.config import EngineSettings
    from services.generator.engine import Engine
    from tests.envs.chat_models import chat_model_dir

    model_dir = chat_model_dir("qwen3", tmp_path_factory.mktemp("chat-engine") / "qwen3")
    engine = Engine(
        EngineSettings(model_dir=model_dir, max_num_seqs=16, max_model_len=1024, kv_cache_memory_bytes=64 * 1024 * 1024)
    )
    await engine.start()
    try:
        yield model_dir, engine
    finally:
        await engine.shutdown()


def bad_input_report_path(config: pytest.Config) -> Path:
    """``$ASY_REPORT_DIR/bad-input.json``, by default under ``.pytest-reports/`` in the checkout."""
    directory = os.environ.get("ASY_REPORT_DIR")
    return (Path(directory) if directory else config.rootpath / ".pytest-reports") / "bad-input.json"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker: hand the bad inputs it tried to the controller, which reports them all."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["bad_inputs"] = BAD_INPUTS.dump()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """On the pytest-xdist controller: take in what a worker tried (its ``pytest_sessionfinish``)."""
    dumped = getattr(node, "workeroutput", {}).get("bad_inputs")
    if dumped:
        BAD_INPUTS.merge(dumped)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The distinct bad inputs the session tried per interface, and the crashes, when it tried any."""
    if hasattr(config, "workeroutput"):
        return  # a worker: the controller reports
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
