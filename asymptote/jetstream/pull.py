"""Fetching from durable pull consumers without nats-py's per-message waits.

Owns :class:`Puller` and :func:`durable_puller`, the broker's path for
taking rollout groups off their work queue and the generators' for eval tasks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import deque

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from nats.js.errors import APIError, NotFoundError

from asymptote.jetstream.inbox import Inbox
from asymptote.jetstream.internals import api_prefix


class Puller(Inbox):
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
        self._api_subject = f"{api_prefix(js)}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._buffer: deque[Msg] = deque()
        self._num_requests = 0
        self._request_subject = ""
        self._request_ended = False
        self._request_error: APIError | None = None
        self._arrived = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
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
        nc = self._conn or await self._client()
        self._num_requests += 1
        self._request_subject = f"{self._reply_prefix}{self._num_requests}"
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

    async def fetch_available(self, batch: int, timeout_s: float = 5.0) -> list[Msg]:
        """Up to ``batch`` messages available now, without waiting for any to be published (maybe none).

        ``timeout_s`` bounds only the round trip to the server.
        """
        if not self._buffer:
            await self._request(batch)
            await self._wait(batch, asyncio.get_running_loop().time() + timeout_s)
        return self._take(batch)

    def take_buffered(self) -> list[Msg]:
        """Every message that arrived and was not fetched yet (leased: the caller acks or naks them)."""
        return self._take(len(self._buffer))

    async def fetch(self, batch: int, timeout_s: float) -> list[Msg]:
        """Up to ``batch`` messages, without waiting once some are in; asyncio.TimeoutError if none came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        available = await self.fetch_available(batch, timeout_s)
        if available:
            return available
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
