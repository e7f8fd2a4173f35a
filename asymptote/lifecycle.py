"""Process lifecycle: SIGTERM/SIGINT set a stop event; main drains; nothing outlives its starter.

A service's ``main()`` parses config, sets up logging, then calls
:func:`run_until_stopped` with its async body, which receives the event.

A command that starts other processes (``asymptote up``, ``asymptote
bench``, the test fixtures) stops them on SIGTERM as on Ctrl-C, through
:func:`interrupt_on_sigterm`, and starts each with :func:`die_with_parent`,
so that even a SIGKILL of the starter, which no handler sees, leaves no
process behind: the kernel sends each child SIGTERM and it drains as it
would under Kubernetes.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from asymptote.errors import ConfigError

log = logging.getLogger(__name__)


def run_until_stopped(body: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``body(stop)`` in a fresh event loop; return a process exit code.

    A ConfigError is logged as its one line and exits 2 (the CLI's code for a user's mistake); any
    other exception is logged with its traceback and exits 1.
    """

    async def _main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _on_signal, sig, stop)
        await body(stop)

    try:
        asyncio.run(_main())
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:  # a setting the service cannot run with (NATS too small, say): no traceback
        log.error("%s", exc)
        return 2
    except Exception:
        log.exception("service failed")
        return 1
    return 0


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    if stop.is_set():
        log.warning("second %s: exiting now", sig.name)
        raise SystemExit(128 + sig.value)
    log.info("%s received: draining", sig.name)
    stop.set()


async def wait_or_stop(stop: asyncio.Event, timeout_s: float) -> bool:
    """Sleep up to ``timeout_s``; True if stop was set meanwhile."""
    try:
        await asyncio.wait_for(stop.wait(), timeout_s)
        return True
    except TimeoutError:
        return False


_PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal the kernel sends this process when the thread that forked it ends."""
_libc: ctypes.CDLL | None = None


def _prctl() -> Callable[..., int] | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        _libc = ctypes.CDLL(name, use_errno=True)
    return _libc.prctl


def die_with_parent(then: Callable[[], None] | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when its starter dies.

    Linux's parent-death signal fires when the *thread* that forked the child
    ends, so it is set only for children started from the main thread (a
    worker thread's exit would stop them early); elsewhere (another thread,
    or no prctl) it is ``then`` alone. ``then`` runs after it in the child
    (core pinning, say). The child checks its parent is still the one that
    forked it: a parent that died before prctl took effect would never signal.
    """
    prctl = _prctl() if threading.current_thread() is threading.main_thread() else None
    if prctl is None:
        return then
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
        if then is not None:
            then()

    return preexec


def die_with_launcher() -> bool:
    """In a process a launcher started in a session of its own (torchrun's ranks): get SIGKILL when the
    launcher dies, as a pod's processes all end with it. Returns whether it is armed (Linux: prctl).

    A launcher killed outright (SIGKILL, the OOM killer) cannot stop its
    ranks itself; left running they would hold the service's ports and its
    place in the next launch's process group.
    """
    prctl = _prctl()
    if prctl is None:
        return False
    parent = os.getppid()
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


@contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM (and SIGHUP) raise KeyboardInterrupt in the main thread, as Ctrl-C does.

    Python's default for SIGTERM ends the process at once, skipping every
    ``finally`` and ``__exit__``: what the process started would keep running.
    Only the first such signal interrupts; later ones are logged and ignored,
    so that a second ``kill`` does not cut the clean stop short (SIGKILL still
    ends it, and :func:`die_with_parent` children then stop themselves).
    Outside the main thread it does nothing (Python delivers signals there only).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        if interrupted:
            log.warning("%s received while stopping: still stopping", signal.Signals(signum).name)
            return
        interrupted = True
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
