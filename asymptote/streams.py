"""NATS JetStream names and wiring: the one place streams, subjects,
consumers and buckets are named and declared.

Every service calls :func:`ensure_streams` at start; declarations are
idempotent, so start order does not matter. A ``prefix`` namespaces one run
so several runs (or tests) can share a NATS server.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass

import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue

from asymptote.config import NatsSettings, read_pem
from asymptote.errors import ConfigError

log = logging.getLogger(__name__)

DEDUP_WINDOW_S = 600.0
"""JetStream duplicate window: a group re-published within it is dropped."""


@dataclass(frozen=True)
class Names:
    """Every stream, subject, durable consumer and KV bucket of one run."""

    prefix: str = "asy"

    # Streams
    @property
    def tasks_stream(self) -> str:
        return f"{self.prefix.upper()}_TASKS"

    @property
    def rollouts_stream(self) -> str:
        return f"{self.prefix.upper()}_ROLLOUTS"

    @property
    def evals_stream(self) -> str:
        return f"{self.prefix.upper()}_EVALS"

    @property
    def telemetry_stream(self) -> str:
        return f"{self.prefix.upper()}_TELEMETRY"

    @property
    def deadletter_stream(self) -> str:
        return f"{self.prefix.upper()}_DEADLETTER"

    @property
    def ledger_stream(self) -> str:
        return f"{self.prefix.upper()}_LEDGER"

    # Subjects
    @property
    def train_tasks(self) -> str:
        return f"{self.prefix}.tasks.train"

    @property
    def eval_tasks(self) -> str:
        return f"{self.prefix}.tasks.eval"

    @property
    def all_tasks(self) -> str:
        return f"{self.prefix}.tasks.>"

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}.rollouts"

    @property
    def eval_results(self) -> str:
        return f"{self.prefix}.evals.results"

    @property
    def telemetry(self) -> str:
        return f"{self.prefix}.telemetry.compute"

    def deadletter(self, source: str) -> str:
        return f"{self.prefix}.deadletter.{source}"

    def ledger(self, task_id: str) -> str:
        return f"{self.prefix}.ledger.{task_id}"

    # Durable consumers (one per consuming role; generators share theirs)
    @property
    def generators_consumer(self) -> str:
        return "generators"

    @property
    def broker_consumer(self) -> str:
        return "broker"

    @property
    def fitter_evals_consumer(self) -> str:
        return "fitter-evals"

    @property
    def fitter_telemetry_consumer(self) -> str:
        return "fitter-telemetry"

    # Key-value buckets
    @property
    def policy_bucket(self) -> str:
        return f"{self.prefix}-policy"

    @property
    def curriculum_bucket(self) -> str:
        return f"{self.prefix}-curriculum"

    policy_key: str = "current"


def stream_configs(names: Names) -> list[StreamConfig]:
    dedup = DEDUP_WINDOW_S
    return [
        # Work queue: each task is leased by exactly one generator and
        # removed once acked (after its group is stored).
        StreamConfig(
            name=names.tasks_stream,
            subjects=[names.train_tasks, names.eval_tasks],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=dedup,
        ),
        # Work queue too: a group stays until the learner's checkpoint
        # holds it and the broker acks it.
        StreamConfig(
            name=names.rollouts_stream,
            subjects=[names.rollouts],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=dedup,
            max_msg_size=8 * 1024 * 1024,
        ),
        StreamConfig(
            name=names.evals_stream,
            subjects=[names.eval_results],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=dedup,
        ),
        StreamConfig(
            name=names.telemetry_stream,
            subjects=[names.telemetry],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=7 * 24 * 3600.0,
            discard=DiscardPolicy.OLD,
        ),
        # Every issued train task's fate (asymptote.ledger); kept, never consumed away.
        StreamConfig(
            name=names.ledger_stream,
            subjects=[names.ledger("*")],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=dedup,
            max_age=30 * 24 * 3600.0,
            discard=DiscardPolicy.OLD,
        ),
        StreamConfig(
            name=names.deadletter_stream,
            subjects=[names.deadletter("*")],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=30 * 24 * 3600.0,
            discard=DiscardPolicy.OLD,
        ),
    ]


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


async def connect(settings: NatsSettings, name: str) -> NatsClient:
    """Connect with the configured credentials; log disconnects loudly.

    A server certificate the client cannot verify raises ConnectionError:
    nats-py itself hangs in that case (nats-io/nats.py#718).
    """
    tls_failed: asyncio.Future[ssl.SSLError] = asyncio.get_running_loop().create_future()

    async def on_error(exc: Exception) -> None:
        if isinstance(exc, ssl.SSLError) and not tls_failed.done():
            tls_failed.set_result(exc)
        log.warning("nats error: %s", exc)

    async def on_disconnect() -> None:
        log.warning("disconnected from nats at %s", settings.url)

    async def on_reconnect() -> None:
        log.info("reconnected to nats")

    kwargs: dict[str, object] = {}
    if settings.user:
        kwargs["user"] = settings.user
        kwargs["password"] = settings.password.get_secret_value() if settings.password else ""
    if settings.creds_file:
        kwargs["user_credentials"] = str(settings.creds_file)
    context = tls_context(settings)
    if context is not None:
        kwargs["tls"] = context
    if settings.tls_hostname:
        kwargs["tls_hostname"] = settings.tls_hostname
    attempt = asyncio.ensure_future(nats.connect(
        servers=[u.strip() for u in settings.url.split(",")],
        name=name,
        connect_timeout=settings.connect_timeout_s,
        max_reconnect_attempts=settings.max_reconnect_attempts,
        reconnect_time_wait=0.5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        **kwargs,  # type: ignore[arg-type]
    ))
    await asyncio.wait({attempt, tls_failed}, return_when=asyncio.FIRST_COMPLETED)
    if attempt.done():
        return attempt.result()
    attempt.cancel()
    await asyncio.gather(attempt, return_exceptions=True)
    raise ConnectionError(f"TLS with NATS at {settings.url} failed: {tls_failed.result()}")


async def ensure_streams(js: JetStreamContext, names: Names) -> None:
    """Declare every stream (idempotent; updates a stream whose config drifted)."""
    for config in stream_configs(names):
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)


async def ensure_bucket(js: JetStreamContext, bucket: str, history: int = 1) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except Exception:  # bucket not found: create it (racing creators are fine)
        try:
            return await js.create_key_value(
                KeyValueConfig(bucket=bucket, history=history, storage=StorageType.FILE)
            )
        except BadRequestError:
            return await js.key_value(bucket)


async def wait_for_nats(settings: NatsSettings, name: str, timeout_s: float) -> NatsClient:
    """Connect, retrying with backoff until ``timeout_s`` (startup ordering)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    delay = 0.2
    while True:
        try:
            return await connect(settings, name)
        except ConfigError:  # a bad certificate setting does not get better by waiting
            raise
        except Exception as exc:  # nats raises several unrelated types here
            if asyncio.get_running_loop().time() + delay > deadline:
                raise ConnectionError(f"cannot reach NATS at {settings.url} within {timeout_s:.0f}s: {exc}") from exc
            log.info("waiting for NATS at %s (%s)", settings.url, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
