"""One wildcard subscription that receives the replies to many requests.

The base of :class:`~asymptote.jetstream.publish.Publisher` and
:class:`~asymptote.jetstream.pull.Puller`: each request replies to
``<inbox>.<token>``, and a subclass's :meth:`Inbox.on_msg` routes the reply
by its token.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from asymptote.jetstream.internals import client_of


class Inbox:
    """Replies to many requests through one wildcard subscription, made on first use."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._conn: NatsClient | None = None
        self._reply_prefix = ""
        """Each request's reply subject is this plus a token; empty until subscribed."""
        self._subscribing = asyncio.Lock()

    async def _client(self) -> NatsClient:
        """The client, with the subscription in place."""
        async with self._subscribing:
            if self._conn is None:
                nc = client_of(self._js)
                prefix = f"{nc.new_inbox()}."
                await nc.subscribe(f"{prefix}*", cb=self.on_msg)
                self._conn, self._reply_prefix = nc, prefix
        return self._conn

    async def on_msg(self, msg: Msg) -> None:
        """Take one reply (its subject is the prefix plus the request's token)."""
        raise NotImplementedError
