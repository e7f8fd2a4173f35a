"""Setting a message aside that no consumer can take: the dead-letter step.

Every consumer refuses bad input the same way: the message's payload goes to
``<prefix>.deadletter.<source>`` with the reason in the ``Asymptote-Reason``
header, the original is terminated so JetStream never redelivers it, and the
service carries on. What counts as bad input is
:mod:`asymptote.messages`' to say; what a consumer counts or records about
it stays with the consumer.
"""

from __future__ import annotations

import logging

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from asymptote.jetstream.names import Names

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 512
"""The reason is cut to this many characters: a header, not a log."""


async def deadletter(
    js: JetStreamContext,
    names: Names,
    msg: Msg,
    source: str,
    reason: str,
    *,
    msg_id: str | None = None,
    terminate: bool = True,
) -> None:
    """Publish ``msg``'s payload to the dead-letter subject of ``source`` with ``reason``, then terminate ``msg``.

    ``msg_id`` deduplicates the dead letter itself, for a message that is
    read again on every start (a replayed stream). ``terminate=False`` is for
    a message that takes no acknowledgement (an ordered consumer's). The
    message is terminated even when the publish raised, which is re-raised.
    """
    log.error("dead-lettering a %s message: %s", source, reason)
    headers = {"Asymptote-Reason": reason[:MAX_REASON_CHARS]}
    if msg_id is not None:
        headers["Nats-Msg-Id"] = msg_id
    try:
        await js.publish(names.deadletter(source), msg.data, headers=headers)
    finally:
        if terminate:
            await msg.term()
