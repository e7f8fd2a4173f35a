"""The policy version announcement in the JetStream KV bucket.

The learner publishes; the broker, generators and fitter watch. A watcher
yields every new version in order (at least the latest one after a gap) and
survives a NATS restart: the watch is re-created on error, and a watch that
stays silent is backed by a direct read of the key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError
from nats.js.kv import KeyValue

from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import PayloadError
from asymptote.jetstream.names import Names
from asymptote.messages import decode_policy

log = logging.getLogger(__name__)

POLL_AFTER_QUIET_S = 2.0
"""Seconds without a watch update after which the key is read directly."""


PUBLISH_RETRY_S = 60.0
"""Seconds a policy announcement is retried for while JetStream cannot take it."""


async def publish_policy(
    kv: KeyValue, names: Names, policy: rollout_pb2.PolicyVersion, retry_s: float = PUBLISH_RETRY_S
) -> None:
    """Put ``policy`` under the policy key. After a NATS restart the client reconnects before JetStream
    has recovered its streams, and a put then times out or finds no responders for some seconds: it is
    retried with backoff for up to ``retry_s``, then the error is raised. A put that reached the store
    before its reply was lost is harmless to repeat: watchers yield each version once."""
    deadline = asyncio.get_running_loop().time() + retry_s
    delay = 0.25
    while True:
        try:
            await kv.put(names.policy_key, policy.SerializeToString())
            return
        except (NatsTimeoutError, NoRespondersError, ServiceUnavailableError) as exc:
            if asyncio.get_running_loop().time() + delay > deadline:
                raise
            log.warning("policy version %d not announced yet (%r); retrying in %.2fs", policy.version, exc, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 4.0)


async def current_policy(kv: KeyValue, names: Names) -> rollout_pb2.PolicyVersion | None:
    try:
        entry = await kv.get(names.policy_key)
    except Exception:  # KeyNotFoundError: no version published yet
        return None
    return decode_policy(entry.value) if entry.value else None


async def watch_policy(kv: KeyValue, names: Names, stop: asyncio.Event) -> AsyncIterator[rollout_pb2.PolicyVersion]:
    """Yield policy versions as they are published, newest last, until stop."""
    last = -1
    while not stop.is_set():
        try:
            watcher = await kv.watch(names.policy_key)
        except Exception as exc:
            log.warning("cannot watch policy version (%s); retrying", exc)
            await asyncio.sleep(1.0)
            continue
        try:
            quiet_s = 0.0
            while not stop.is_set():
                entry: KeyValue.Entry | None
                try:
                    # nats-py leaves KeyWatcher's methods unannotated.
                    entry = await watcher.updates(timeout=1.0)  # type: ignore[no-untyped-call]
                    quiet_s = 0.0
                except TimeoutError:  # nats raises its subclass, or asyncio's own
                    # After a server restart a watch can stay silent until its
                    # consumer is reset; a direct read every few quiet seconds
                    # catches up at once.
                    quiet_s += 1.0
                    if quiet_s < POLL_AFTER_QUIET_S:
                        continue
                    quiet_s = 0.0
                    try:
                        entry = await kv.get(names.policy_key)
                    except Exception:
                        continue
                if entry is None or not entry.value:
                    continue
                try:
                    policy = decode_policy(entry.value)
                except PayloadError as exc:
                    log.error("ignoring bad policy version entry: %s", exc)
                    continue
                if policy.version > last:
                    last = policy.version
                    yield policy
        finally:
            try:
                await watcher.stop()  # type: ignore[no-untyped-call]
            except Exception:
                pass
