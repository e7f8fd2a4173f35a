"""A policy announcement put while NATS restarts lands once the server is back, instead of failing.

After a restart the client reconnects before JetStream has recovered its
streams, and a put times out or finds no responders; the learner's
announcement retries with backoff for a bounded time (``PUBLISH_RETRY_S``).
Before, one such timeout ended the learner (a faults run restarted it once
more than the faults injected).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names, ensure_bucket
from asymptote.nats_local import start_nats
from asymptote.policy import publish_policy


async def test_an_announcement_during_a_nats_restart_lands_when_the_server_is_back(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    server = start_nats(store)
    names = Names("announce")
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        kv = await ensure_bucket(nc.jetstream(), names.policy_bucket, replicas=1)
        policy = rollout_pb2.PolicyVersion(version=7)
        server.process.kill()
        server.process.wait(10)
        announcing = asyncio.create_task(publish_policy(kv, names, policy, retry_s=60.0))
        await asyncio.sleep(0)  # the first put is in flight against no server
        assert not announcing.done()
        server = start_nats(store, port=server.port)
        await asyncio.wait_for(announcing, 60)
        assert rollout_pb2.PolicyVersion.FromString((await kv.get(names.policy_key)).value or b"") == policy
        # Bounded: with no server at all the error comes out once retry_s has passed.
        server.process.kill()
        server.process.wait(10)
        with pytest.raises(NatsTimeoutError):
            await asyncio.wait_for(publish_policy(kv, names, rollout_pb2.PolicyVersion(version=8), retry_s=1.0), 30)
    finally:
        await nc.close()
        server.stop()
