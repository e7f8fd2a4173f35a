"""NATS JetStream names and wiring: the one place streams, subjects,
consumers and buckets are named and declared, plus the connection and the
lean publish and fetch paths of hot loops (:class:`Publisher`,
:class:`Puller`).

Every service calls :func:`ensure_streams` at start; declarations are
idempotent, so start order does not matter. A ``prefix`` namespaces one run
so several runs (or tests) can share a NATS server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import ssl
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NoStreamResponseError, NotFoundError
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
    attempt = asyncio.ensure_future(
        nats.connect(
            servers=[u.strip() for u in settings.url.split(",")],
            name=name,
            connect_timeout=settings.connect_timeout_s,
            max_reconnect_attempts=settings.max_reconnect_attempts,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            **kwargs,  # type: ignore[arg-type]
        )
    )
    await asyncio.wait({attempt, tls_failed}, return_when=asyncio.FIRST_COMPLETED)
    if attempt.done():
        return attempt.result()
    attempt.cancel()
    await asyncio.gather(attempt, return_exceptions=True)
    raise ConnectionError(f"TLS with NATS at {settings.url} failed: {tls_failed.result()}")


@dataclass(frozen=True)
class Outgoing:
    """One message for a stream, under its deduplication id."""

    subject: str
    payload: bytes
    msg_id: str


class _Inbox:
    """Replies to many requests through one wildcard subscription, made on first use."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._nc: NatsClient | None = None
        self._prefix = ""
        """Each request's reply subject is this plus a token; empty until subscribed."""
        self._subscribing = asyncio.Lock()

    async def _client(self) -> NatsClient:
        """The client, with the subscription in place."""
        async with self._subscribing:
            if self._nc is None:
                nc = _client_of(self._js)
                prefix = f"{nc.new_inbox()}."
                await nc.subscribe(f"{prefix}*", cb=self._on_msg)
                self._nc, self._prefix = nc, prefix
        return self._nc

    async def _on_msg(self, msg: Msg) -> None:
        raise NotImplementedError


class Publisher(_Inbox):
    """JetStream publishes sent back to back, their acknowledgements awaited together.

    ``js.publish`` makes a request per message: a reply future, a timer, a
    JSON decode and a dataclass per acknowledgement, which cost more CPU
    than the server spends storing the message. The broker records and
    publishes thousands of messages a second, so this publisher sends each
    message with a reply subject under one wildcard subscription and waits
    for a whole list under one deadline. Same guarantees: a message counts
    as stored only once its acknowledgement arrived without an error.
    """

    def __init__(self, js: JetStreamContext) -> None:
        super().__init__(js)
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._next_token = 0

    async def _on_msg(self, msg: Msg) -> None:
        future = self._pending.pop(msg.subject[len(self._prefix) :], None)
        if future is None or future.done():  # timed out meanwhile
            return
        if msg.headers and msg.headers.get("Status") == "503":
            future.set_exception(NoStreamResponseError())
        else:
            future.set_result(msg.data)

    async def publish_all(self, messages: Sequence[Outgoing], timeout_s: float = 10.0) -> list[bool]:
        """Publish ``messages`` in order; True for each one the stream already held (a duplicate id).

        Raises once every acknowledgement has arrived or the deadline passed:
        the first error the server returned, NoStreamResponseError when no
        stream takes a subject, nats TimeoutError when acknowledgements are
        missing. A message whose acknowledgement is missing may still be
        stored; publishing it again under the same id is safe.
        """
        if not messages:
            return []
        nc = self._nc or await self._client()
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[bytes]] = []
        tokens: list[str] = []
        for m in messages:
            token = str(self._next_token)
            self._next_token += 1
            future: asyncio.Future[bytes] = loop.create_future()
            self._pending[token] = future
            futures.append(future)
            tokens.append(token)
            await nc.publish(m.subject, m.payload, reply=self._prefix + token, headers={"Nats-Msg-Id": m.msg_id})
        try:
            _, missing = await asyncio.wait(futures, timeout=timeout_s)
        finally:
            for token in tokens:
                self._pending.pop(token, None)
        if missing:
            for future in missing:
                future.cancel()
            raise NatsTimeoutError()
        duplicates: list[bool] = []
        for future in futures:
            data = future.result()  # raises NoStreamResponseError
            if b'"error":' in data:
                raise APIError.from_error(json.loads(data)["error"])
            # The server leaves "duplicate" out unless it is true (and spells that
            # as '"duplicate": true'); decoding only then keeps the common case cheap.
            duplicates.append(b'"duplicate"' in data and bool(json.loads(data).get("duplicate")))
        return duplicates


class Puller(_Inbox):
    """Fetches from a durable pull consumer, returning as soon as the available messages are in.

    nats-py's ``fetch`` waits on each message through a task and a timer of
    its own (several times the CPU the message costs otherwise), and once a
    long poll has brought one message it holds on until the batch is full
    or the timeout passes, so a consumer that drained its stream sits idle
    while messages wait in its inbox. Here one wildcard subscription
    receives everything: a fetch takes what is buffered, else asks for what
    is available now (``no_wait``), else waits for the first message and
    then takes whatever has arrived with it. Each request replies to a
    subject of its own, so the end-of-request status of an abandoned
    request is never taken for the current one's; messages that arrive
    after their request was given up on are buffered for the next fetch.
    """

    def __init__(self, js: JetStreamContext, stream: str, durable: str) -> None:
        super().__init__(js)
        self._api_subject = f"{js._prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"  # type: ignore[attr-defined]
        self._buffer: deque[Msg] = deque()
        self._num_requests = 0
        self._request_subject = ""
        self._request_ended = False
        self._request_error: APIError | None = None
        self._arrived = asyncio.Event()

    async def _on_msg(self, msg: Msg) -> None:
        headers = msg.headers or {}
        status = headers.get("Status") if not msg.data else None
        if status is None:
            self._buffer.append(msg)
        elif msg.subject == self._request_subject:
            # 404 (nothing more now) and 408 (expired) end a request; anything
            # else (409: consumer deleted, too many waiting requests) fails it.
            self._request_ended = True
            if status not in ("404", "408"):
                self._request_error = APIError(code=int(status), description=headers.get("Description", ""))
        else:
            return  # the end of a request given up on
        self._arrived.set()

    async def _request(self, batch: int, expires_s: float | None = None) -> None:
        nc = self._nc or await self._client()
        self._num_requests += 1
        self._request_subject = f"{self._prefix}{self._num_requests}"
        self._request_ended, self._request_error = False, None
        request: dict[str, object] = {"batch": batch}
        if expires_s is None:
            request["no_wait"] = True
        else:
            request["expires"] = int(expires_s * 1e9)
        await nc.publish(self._api_subject, json.dumps(request).encode(), reply=self._request_subject)

    async def _wait(self, num: int, deadline: float) -> None:
        """Until ``num`` messages are buffered, the current request ends, or the deadline."""
        loop = asyncio.get_running_loop()
        while len(self._buffer) < num and not self._request_ended:
            self._arrived.clear()
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return
        if self._request_error is not None:
            raise self._request_error

    def _take(self, batch: int) -> list[Msg]:
        return [self._buffer.popleft() for _ in range(min(batch, len(self._buffer)))]

    async def fetch(self, batch: int, timeout_s: float) -> list[Msg]:
        """Up to ``batch`` messages, without waiting once some are in; asyncio.TimeoutError if none came."""
        if self._buffer:
            return self._take(batch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        await self._request(batch)
        await self._wait(batch, deadline)
        if not self._buffer:
            # Nothing now: wait for one message. The server lets the request
            # expire a little before the deadline, so it rarely outlives it
            # (a message it brings later waits in the buffer).
            await self._request(1, expires_s=max(deadline - loop.time() - 0.05, 0.001))
            await self._wait(1, deadline)
            if not self._buffer:
                raise TimeoutError()
            if batch > 1:  # and take what came with it
                await self._request(batch - 1)
                await self._wait(batch, deadline)
        return self._take(batch)


async def durable_puller(
    js: JetStreamContext, stream: str, subject: str, durable: str, config: ConsumerConfig
) -> Puller:
    """A Puller on the durable consumer, created with ``config`` (filtered to ``subject``) if it does not exist.

    An existing consumer is used as it is, as ``js.pull_subscribe`` does.
    """
    try:
        await js.consumer_info(stream, durable)
    except NotFoundError:
        config = dataclasses.replace(config, durable_name=durable, name=durable, filter_subject=subject)
        await js.add_consumer(stream, config=config)
    return Puller(js, stream, durable)


def _client_of(js: JetStreamContext) -> NatsClient:
    # nats-py's JetStreamContext offers no public accessor for the client it talks through.
    return js._nc  # type: ignore[attr-defined,no-any-return]


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
            return await js.create_key_value(KeyValueConfig(bucket=bucket, history=history, storage=StorageType.FILE))
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
