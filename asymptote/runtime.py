"""What every service process does around its own work.

Starts the HTTP health/metrics server, connects to NATS and declares the
streams, runs the service's loops under one supervisor (a loop that dies
takes the service down loudly), and on stop flips health to not-serving
first, gives loops a grace period to drain, then closes connections.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry

from asymptote.config import ListenSettings, NatsSettings
from asymptote.health import Health, start_http
from asymptote.jetstream.connect import wait_for_nats
from asymptote.jetstream.names import Names
from asymptote.jetstream.preflight import declare_streams

log = logging.getLogger(__name__)


def instance_id(service: str) -> str:
    """Pod name in Kubernetes (HOSTNAME), else host-pid, plus a short nonce."""
    base = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    return f"{service}-{base}-{uuid.uuid4().hex[:4]}"


@dataclass
class Runtime:
    service: str
    instance_id: str
    names: Names
    nc: NatsClient
    js: JetStreamContext
    health: Health
    registry: CollectorRegistry
    http_port: int


@asynccontextmanager
async def service_runtime(
    service: str,
    nats_settings: NatsSettings,
    prefix: str,
    http: ListenSettings,
    registry: CollectorRegistry,
    nats_wait_s: float = 60.0,
) -> AsyncIterator[Runtime]:
    health = Health(service)
    runner, http_port = await start_http(health, registry, http)

    async def nats_down() -> None:
        await health.block("nats", f"disconnected from {nats_settings.url}")

    async def nats_up() -> None:
        await health.unblock("nats")

    try:
        nc = await wait_for_nats(nats_settings, service, nats_wait_s, on_disconnect=nats_down, on_reconnect=nats_up)
        js = nc.jetstream(timeout=10.0)
        names = Names(prefix, nats_settings.stream_replicas)
        # JetStream on and the replicas possible, or one line naming the setting (preflight).
        await declare_streams(js, names, nats_settings.url)
        rt = Runtime(service, instance_id(service), names, nc, js, health, registry, http_port)
        try:
            yield rt
        finally:
            await health.shutting_down()
            try:
                await asyncio.wait_for(nc.drain(), 5.0)
            except Exception as exc:
                log.warning("nats drain: %s", exc)
    finally:
        await runner.cleanup()


async def supervise(stop: asyncio.Event, loops: dict[str, Coroutine[Any, Any, None]], grace_s: float = 10.0) -> None:
    """Run ``loops`` until stop or until one fails; then drain and re-raise.

    A loop that returns before stop is a bug in that loop only if it raised;
    returning normally just means its work is done.
    """

    async def stopped() -> None:
        await stop.wait()

    tasks = {asyncio.create_task(coro, name=name): name for name, coro in loops.items()}
    stopper = asyncio.create_task(stopped(), name="stop")
    failure: tuple[str, BaseException] | None = None
    pending = set(tasks)
    while pending and failure is None and not stop.is_set():
        done, pending = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
        pending.discard(stopper)
        for task in done:
            if task is stopper or task.cancelled():
                continue
            exc = task.exception()
            if exc is not None:
                failure = (tasks[task], exc)
                log.error("loop %s died: %r", tasks[task], exc, exc_info=exc)
    stop.set()
    if pending:
        _, still = await asyncio.wait(pending, timeout=grace_s)
        for task in still:
            task.cancel()
        await asyncio.gather(*still, return_exceptions=True)
    stopper.cancel()
    if failure is not None:
        raise RuntimeError(f"{failure[0]} loop died: {failure[1]!r}") from failure[1]
