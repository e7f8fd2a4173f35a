"""Publishing to streams back to back, the acknowledgements awaited together.

Owns :class:`Publisher`, the broker's and the ledger's path for storing many
messages a second, each under its deduplication id.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

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


class Publisher(Inbox):
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

    async def on_msg(self, msg: Msg) -> None:
        future = self._pending.pop(msg.subject[len(self._reply_prefix) :], None)
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
        nc = self._conn or await self._client()
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
            await nc.publish(m.subject, m.payload, reply=self._reply_prefix + token, headers={"Nats-Msg-Id": m.msg_id})
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
