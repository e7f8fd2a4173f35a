"""A real nats-server with JetStream for the integration tests (one per session)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from asymptote.nats_local import NatsServer, nats_server


@pytest.fixture(scope="session")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with nats_server(Path(tmp_path_factory.mktemp("nats"))) as server:
        yield server
