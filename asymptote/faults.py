"""Failpoints: deterministic fault injection at named points inside the services.

Random SIGKILLs from outside rarely land inside the short windows that
matter most (a weight swap with the engine paused, a checkpoint half
written). A failpoint is a named place in the code that kills its own
process group with SIGKILL, as a node failure or the OOM killer would kill a
pod, when the environment arms it:

    ASY_FAILPOINTS="generator.swap.paused:75,learner.checkpoint.written:76"
    ASY_FAILPOINT_DIR=/path/shared/by/the/run

``name:N`` fires the first time the point is reached with a progress value
(a policy version or a step) of at least N. Each fires once per run: a
marker file in ``ASY_FAILPOINT_DIR`` keeps the restarted process from
firing it again. Unarmed, a failpoint costs one dict lookup.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "ASY_FAILPOINTS"
DIR_ENV = "ASY_FAILPOINT_DIR"


def parse(spec: str) -> dict[str, int]:
    """``"a:3,b:0"`` -> {"a": 3, "b": 0}; a clear error naming the bad entry otherwise."""
    armed: dict[str, int] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, sep, at = entry.partition(":")
        if not sep or not name or not at.strip().isdigit():
            raise ValueError(f"{ENV}: {entry!r} is not name:N (N a non-negative integer)")
        armed[name.strip()] = int(at)
    return armed


_ARMED = parse(os.environ.get(ENV, ""))


def fired_marker(name: str) -> Path | None:
    root = os.environ.get(DIR_ENV)
    return Path(root) / f"{name}.fired" if root else None


def failpoint(name: str, progress: int) -> None:
    """Kill this process group here if ``name`` is armed for ``progress`` and has not fired yet."""
    at = _ARMED.get(name)
    if at is None or progress < at:
        return
    marker = fired_marker(name)
    if marker is not None:
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{progress}\n")
    log.warning("failpoint %s at %d: killing this process group with SIGKILL", name, progress)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.killpg(os.getpgid(0), signal.SIGKILL)
