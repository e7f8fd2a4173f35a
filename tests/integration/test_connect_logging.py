"""A connection's disconnect warning means the server went away, never that the client closed it.

nats-py calls the disconnect callback on a deliberate ``close()`` as well;
logging that as a warning printed a stray "disconnected from nats" after
every local run's summary. A server that really goes away still warns, and
the service's hook still runs.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from asymptote.config import NatsSettings
from asymptote.jetstream.connect import connect
from asymptote.nats_local import NatsServer, start_nats

LOGGER = "asymptote.jetstream.connect"


async def test_closing_a_connection_warns_of_nothing(nats: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    hooked: list[str] = []

    async def on_disconnect() -> None:
        hooked.append("down")

    caplog.set_level(logging.DEBUG, logger=LOGGER)
    nc = await connect(NatsSettings(url=nats.url), "closer", on_disconnect=on_disconnect)
    await nc.close()
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    assert warnings == [] and hooked == []
    assert any("closed the connection" in r.getMessage() for r in caplog.records if r.name == LOGGER)


async def test_a_server_that_goes_away_is_warned_of(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = start_nats(tmp_path)
    down = asyncio.Event()

    async def on_disconnect() -> None:
        down.set()

    try:
        nc = await connect(
            NatsSettings(url=server.url, max_reconnect_attempts=1), "watcher", on_disconnect=on_disconnect
        )
        server.stop()
        await asyncio.wait_for(down.wait(), timeout=30)
        await nc.close()
    finally:
        server.stop()
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert f"disconnected from nats at {server.url}" in warnings
