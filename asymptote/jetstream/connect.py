"""Connecting to NATS: credentials, TLS, and waiting for a server that is still starting.

Owns turning :class:`~asymptote.config.NatsSettings` into a connected
client. Knows nothing of streams or subjects (:mod:`asymptote.jetstream.names`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client as NatsClient

from asymptote.config import NatsSettings, read_pem
from asymptote.errors import ConfigError

log = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]
"""Called (and awaited) on a connection event, after it is logged."""


def tls_context(settings: NatsSettings) -> ssl.SSLContext | None:
    """The client's TLS context when a CA or a client certificate is configured, else None.

    ``tls_ca_file`` replaces the system's CAs; ``tls_cert_file`` and
    ``tls_key_file`` are presented to a server that verifies clients.
    """
    if settings.tls_ca_file is None and settings.tls_cert_file is None:
        return None
    ca = read_pem("nats.tls_ca_file", settings.tls_ca_file).decode() if settings.tls_ca_file else None
    context = ssl.create_default_context(cadata=ca)
    if settings.tls_cert_file and settings.tls_key_file:
        read_pem("nats.tls_cert_file", settings.tls_cert_file)
        read_pem("nats.tls_key_file", settings.tls_key_file)
        try:
            context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"nats.tls_cert_file/tls_key_file: {settings.tls_cert_file} with {settings.tls_key_file}: {exc}"
            ) from exc
    return context


async def connect(
    settings: NatsSettings, name: str, on_disconnect: Hook | None = None, on_reconnect: Hook | None = None
) -> NatsClient:
    """Connect with the configured credentials; log disconnects loudly, then call the hooks.

    A server certificate the client cannot verify raises ConnectionError:
    nats-py itself hangs in that case (nats-io/nats.py#718).
    """
    tls_failed: asyncio.Future[ssl.SSLError] = asyncio.get_running_loop().create_future()

    async def error_cb(exc: Exception) -> None:
        if isinstance(exc, ssl.SSLError) and not tls_failed.done():
            tls_failed.set_result(exc)
        log.warning("nats error: %s", exc)

    async def disconnected_cb() -> None:
        client = attempt.result() if attempt.done() and not attempt.cancelled() and not attempt.exception() else None
        if client is not None and client.is_closed:
            # nats-py calls this on a deliberate close() too: nothing was lost.
            log.debug("closed the connection to nats at %s", settings.url)
            return
        log.warning("disconnected from nats at %s", settings.url)
        if on_disconnect is not None:
            await on_disconnect()

    async def reconnected_cb() -> None:
        log.info("reconnected to nats")
        if on_reconnect is not None:
            await on_reconnect()

    password = settings.password.get_secret_value() if settings.password else ""
    attempt = asyncio.ensure_future(
        nats.connect(
            servers=[u.strip() for u in settings.url.split(",")],
            name=name,
            connect_timeout=settings.connect_timeout_s,
            max_reconnect_attempts=settings.max_reconnect_attempts,
            reconnect_time_wait=0.5,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            # None is nats-py's own default for each of these.
            user=settings.user or None,
            password=password if settings.user else None,
            user_credentials=str(settings.creds_file) if settings.creds_file else None,
            tls=tls_context(settings),
            tls_hostname=settings.tls_hostname or None,
        )
    )
    racers: set[asyncio.Future[Any]] = {attempt, tls_failed}
    await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
    if attempt.done():
        return attempt.result()
    attempt.cancel()
    await asyncio.gather(attempt, return_exceptions=True)
    raise ConnectionError(f"TLS with NATS at {settings.url} failed: {tls_failed.result()}")


async def wait_for_nats(
    settings: NatsSettings,
    name: str,
    timeout_s: float,
    on_disconnect: Hook | None = None,
    on_reconnect: Hook | None = None,
) -> NatsClient:
    """:func:`connect`, retrying with backoff until ``timeout_s`` (startup ordering)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    delay = 0.2
    while True:
        try:
            return await connect(settings, name, on_disconnect, on_reconnect)
        except ConfigError:  # a bad certificate setting does not get better by waiting
            raise
        except Exception as exc:  # nats raises several unrelated types here
            if asyncio.get_running_loop().time() + delay > deadline:
                raise ConnectionError(f"cannot reach NATS at {settings.url} within {timeout_s:.0f}s: {exc}") from exc
            log.info("waiting for NATS at %s (%s)", settings.url, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
