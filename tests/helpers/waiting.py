"""Waiting for an event in a test: poll it, with a deadline, and say what never came.

A test that sleeps a fixed time and then looks is a bet on the machine's
speed: too short on a loaded machine, wasted time on an idle one. These
helpers poll the event itself and fail with an AssertionError that names
what was awaited (and the last value seen) when the deadline passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_INTERVAL_S = 0.05
"""Pause between two polls: short next to any deadline, long enough not to spin a core."""


def _timed_out(what: str, timeout_s: float, last: object) -> AssertionError:
    return AssertionError(f"timed out after {timeout_s:g}s waiting for {what} (last seen: {last!r})")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = DEFAULT_INTERVAL_S) -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    Polls at once, then every ``interval_s``; raises AssertionError naming
    ``what`` (e.g. "the broker to issue 4 train tasks") once ``timeout_s``
    has passed without a truthy value. An exception from ``predicate``
    propagates.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s, value)
        time.sleep(interval_s)  # pacing: the pause between two polls of the event


async def wait_until_async(
    predicate: Callable[[], Awaitable[T]], timeout_s: float, what: str, interval_s: float = DEFAULT_INTERVAL_S
) -> T:
    """``wait_until`` for a test on the event loop, polling a coroutine function.

    Between polls the loop runs other tasks (the service under test among them).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if loop.time() >= deadline:
            raise _timed_out(what, timeout_s, value)
        await asyncio.sleep(interval_s)  # pacing: the pause between two polls of the event
