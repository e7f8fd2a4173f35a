"""The only code that reads nats-py's private attributes.

:class:`~asymptote.jetstream.publish.Publisher` and
:class:`~asymptote.jetstream.pull.Puller` replace ``js.publish`` and a pull
subscription's ``fetch`` on the hot paths (their docstrings say why) by
talking to the JetStream API over the core client themselves. For that they
need two things a ``JetStreamContext`` holds and nats-py 2.x exposes no
accessor for: the client it talks through, and its API subject prefix
(``$JS.API``, or ``$JS.<domain>.API``). Reading them here keeps every caller
on the one ``JetStreamContext`` it already has, and leaves one place to
change when nats-py moves them.
"""

from __future__ import annotations

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext


def client_of(js: JetStreamContext) -> NatsClient:
    """The core client ``js`` publishes and subscribes through."""
    return js._nc


def api_prefix(js: JetStreamContext) -> str:
    """The subject prefix of ``js``'s JetStream API requests, without a trailing dot."""
    return js._prefix
