"""Publishing to streams back to back, the acknowledgements awaited together.

Owns :class:`Publisher`, the broker's and the ledger's path for storing many
messages a second, each under its deduplication id.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError

from asymptote.jetstream.inbox import Inbox


@dataclass(frozen=True)
class Outgoing:
    """One message for a stream, under its deduplication id."""

    subject: str
    payload: bytes
    msg_id: str


class Stored(NamedTuple):
    """What the stream answered for one message."""

    seq: int
    """Its stream sequence (a duplicate's is the sequence of the copy stored first)."""
    duplicate: bool
    """The stream already held a message under this id within its duplicate window."""


DEFAULT_WINDOW = 512
"""Publishes in flight at most: past it, the next waits for the oldest acknowledgement."""


def parse_ack(data: bytes) -> Stored:
    """A publish acknowledgement, read without a JSON decode in the common case; raises the server's error."""
    if b'"error":' in data:
        raise APIError.from_error(json.loads(data)["error"])
    # The server writes '"seq":N' and leaves "duplicate" out unless it is true.
    start = data.find(b'"seq":')
    if start < 0:
        ack = json.loads(data)
        return Stored(int(ack.get("seq", 0)), bool(ack.get("duplicate")))
    start += 6
    end = start
    while end < len(data) and 48 <= data[end] <= 57:  # ASCII digits
        end += 1
    return Stored(int(data[start:end]), b'"duplicate"' in data and bool(json.loads(data).get("duplicate")))


class Publisher(Inbox):
    """JetStream publishes sent back to back, their acknowledgements awaited together.

    ``js.publish`` makes a request per message: a reply future, a timer, a
    JSON decode and a dataclass per acknowledgement, which cost more CPU
    than the server spends storing the message. The broker records and
    publishes thousands of messages a second, so this publisher sends each
    message with a reply subject under one wildcard subscription and waits
    for a whole list under one deadline, with a bounded window of
    acknowledgements pending. Same guarantees: a message counts as stored
    only once its acknowledgement arrived without an error.
    """

    def __init__(self, js: JetStreamContext) -> None:
        super().__init__(js)
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._next_token = 0

    async def on_msg(self, msg: Msg) -> None:
        future = self._pending.pop(msg.subject[len(self._reply_prefix) :], None)
        if future is None or future.done():  # timed out meanwhile
            return
        if msg.headers and msg.headers.get("Status") == "503":
            future.set_exception(NoStreamResponseError())
        else:
            future.set_result(msg.data)

    async def publish_all(
        self, messages: Sequence[Outgoing], timeout_s: float = 10.0, window: int = DEFAULT_WINDOW
    ) -> list[Stored]:
        """Publish ``messages`` in order; for each, its sequence and whether the stream already held it.

        At most ``window`` acknowledgements are awaited at once: past it, the
        next message waits for the oldest one (which bounds what the server
        and this process buffer for one long list). Raises once every
        acknowledgement has arrived or the deadline passed: the first error
        the server returned, NoStreamResponseError when no stream takes a
        subject, nats TimeoutError when acknowledgements are missing. A
        message whose acknowledgement is missing may still be stored;
        publishing it again under the same id is safe.
        """
        if not messages:
            return []
        nc = self._conn or await self._client()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        futures: list[asyncio.Future[bytes]] = []
        tokens: list[str] = []
        try:
            for i, m in enumerate(messages):
                if i >= window and not futures[i - window].done():
                    await asyncio.wait([futures[i - window]], timeout=max(deadline - loop.time(), 0.0))
                    if not futures[i - window].done():
                        break  # out of time: the rest is not sent, and the wait below raises
                token = str(self._next_token)
                self._next_token += 1
                future: asyncio.Future[bytes] = loop.create_future()
                self._pending[token] = future
                futures.append(future)
                tokens.append(token)
                await nc.publish(
                    m.subject, m.payload, reply=self._reply_prefix + token, headers={"Nats-Msg-Id": m.msg_id}
                )
            _, missing = await asyncio.wait(futures, timeout=max(deadline - loop.time(), 0.0))
        finally:
            for token in tokens:
                self._pending.pop(token, None)
        if missing:
            for future in missing:
                future.cancel()
            raise NatsTimeoutError()
        return [parse_ack(future.result()) for future in futures]  # result() raises NoStreamResponseError
