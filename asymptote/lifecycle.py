"""Process lifecycle: SIGTERM/SIGINT set a stop event; main drains.

A service's ``main()`` parses config, sets up logging, then calls
:func:`run_until_stopped` with its async body, which receives the event.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


def run_until_stopped(body: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``body(stop)`` in a fresh event loop; return a process exit code."""

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
