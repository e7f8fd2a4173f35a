"""Failpoints: deterministic fault injection at named points inside the services.

Random SIGKILLs from outside rarely land inside the short windows that
matter most (a weight swap with the engine paused, a checkpoint half
written). A failpoint is a named place in the code that kills its own
process group with SIGKILL, as a node failure or the OOM killer would kill a
pod, when the environment arms it:

    ASY_FAILPOINTS="generator.swap.paused:75,learner.checkpoint.written:76"
    ASY_FAILPOINT_DIR=/path/shared/by/the/run

``name:N`` fires the first time the point is reached with a progress value
(a policy version or a step) of at least N; the same name armed again
(``name:40,name:90``) fires again at each further threshold. Each threshold
fires once per run: a marker file in ``ASY_FAILPOINT_DIR``
(``name@N.fired``) keeps the restarted process from firing it again.

``name:file`` arms a point from outside while the run goes on: it fires the
next time it is reached after a file ``name.arm`` appears in
``ASY_FAILPOINT_DIR``, and records ``name#<the file's text>.fired`` in its
place. A fault-injection driver uses it to put each fault where it wants it
without two faults overlapping.

``name:N:raise`` (or ``name:file:raise``) raises ``InjectedFault`` at the
point instead of killing: a bug's exception in the middle of the work, which
the service must turn into a clean failure (the learner's ranks all exit,
none waiting in a collective).

Unarmed, a failpoint costs one dict lookup; armed by file, one stat.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "ASY_FAILPOINTS"
DIR_ENV = "ASY_FAILPOINT_DIR"
BY_FILE = "file"


RAISE = "raise"


class InjectedFault(RuntimeError):
    """The exception a failpoint armed with ``:raise`` raises."""


@dataclass
class Armed:
    thresholds: tuple[int, ...] = ()
    """Progress values at which the point fires, once each."""
    by_file: bool = False
    """Also fires when ``<name>.arm`` appears in the marker directory."""
    raises: bool = False
    """Fires by raising ``InjectedFault`` instead of killing the process group."""


def parse(spec: str) -> dict[str, Armed]:
    """``"a:3,b:file,a:9,c:2:raise"`` -> {"a": Armed((3, 9)), "b": Armed(by_file=True), "c": Armed((2,),
    raises=True)}; a clear error naming a bad entry."""
    thresholds: dict[str, set[int]] = {}
    by_file: set[str] = set()
    raising: set[str] = set()
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, sep, rest = (part.strip() for part in entry.partition(":"))
        at, has_action, action = (part.strip() for part in rest.partition(":"))
        if not sep or not name or not (at.isdigit() or at == BY_FILE) or (has_action and action != RAISE):
            raise ValueError(
                f"{ENV}: {entry!r} is not name:N (N a non-negative integer) or name:{BY_FILE}, "
                f"optionally followed by :{RAISE}"
            )
        if at == BY_FILE:
            by_file.add(name)
        else:
            thresholds.setdefault(name, set()).add(int(at))
        if action == RAISE:
            raising.add(name)
    return {
        name: Armed(tuple(sorted(thresholds.get(name, ()))), name in by_file, name in raising)
        for name in sorted(thresholds.keys() | by_file)
    }


_ARMED = parse(os.environ.get(ENV, ""))


def marker_dir() -> Path | None:
    root = os.environ.get(DIR_ENV)
    return Path(root) if root else None


def failpoint(name: str, progress: int) -> None:
    """Kill this process group here (or raise ``InjectedFault``) if ``name`` is armed for this moment
    (see the module docstring)."""
    armed = _ARMED.get(name)
    if armed is None:
        return
    root = marker_dir()
    marker = _due_threshold(name, armed, progress, root)
    if marker is None and armed.by_file and root is not None:
        marker = _consume_arm_file(name, root)
    if marker is None:
        return
    marker.write_text(f"{progress}\n")
    if armed.raises:
        log.warning("failpoint %s at %d: raising", name, progress)
        raise InjectedFault(f"failpoint {name} at {progress}")
    log.warning("failpoint %s at %d: killing this process group with SIGKILL", name, progress)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _due_threshold(name: str, armed: Armed, progress: int, root: Path | None) -> Path | None:
    """The marker to write for the lowest threshold reached and not fired yet; None if none is due."""
    for at in armed.thresholds:
        if progress < at:
            return None
        if root is None:
            return Path(os.devnull)  # nowhere to remember it: fires every time
        marker = root / f"{name}@{at}.fired"
        if not marker.exists():
            root.mkdir(parents=True, exist_ok=True)
            return marker
    return None


def _consume_arm_file(name: str, root: Path) -> Path | None:
    arm = root / f"{name}.arm"
    try:
        label = arm.read_text().strip()
        arm.unlink()
    except FileNotFoundError:
        return None
    return root / f"{name}#{label}.fired"


def arm(root: Path, name: str, label: str) -> Path:
    """Arm ``name`` (configured as ``name:file``) to fire the next time it is reached; returns its marker."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.arm.tmp"
    tmp.write_text(label)
    tmp.rename(root / f"{name}.arm")  # whole or absent: the point never reads half a label
    return root / f"{name}#{label}.fired"
