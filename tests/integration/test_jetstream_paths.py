"""The broker's JetStream paths against a real nats-server: Publisher, Puller, Ledger.

Publisher and Puller replace nats-py's per-message request and fetch in the
broker's hot loops; these tests pin what they must still guarantee (every
acknowledgement checked, duplicates reported, errors raised; a fetch returns
what is available and loses nothing it was sent). The Ledger tests pin how
the broker knows which tasks have ended: from its own records, and from one
lookup per task it did not record itself (a restarted broker).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NoStreamResponseError

from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names, ensure_bucket, ensure_streams, stream_configs
from asymptote.jetstream.publish import Outgoing, Publisher, Stored
from asymptote.jetstream.pull import durable_puller
from asymptote.nats_local import NatsServer
from tests.helpers.waiting import wait_until_async

Event = rollout_pb2.LedgerEvent
_ids = itertools.count()


async def _connect(server: NatsServer) -> NatsClient:
    return await nats.connect(server.url)


@pytest.fixture
async def nc(nats: NatsServer) -> AsyncIterator[NatsClient]:
    client = await _connect(nats)  # the fixture's name hides the nats module here
    yield client
    await client.close()


async def work_queue(nc: NatsClient, max_msg_size: int = -1) -> tuple[str, str]:
    """A fresh work-queue stream with dedup; (stream, subject)."""
    n = next(_ids)
    stream, subject = f"JSP{n}", f"jsp{n}.work"
    await nc.jetstream().add_stream(
        StreamConfig(
            name=stream,
            subjects=[subject],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=60.0,
            max_msg_size=max_msg_size,
        )
    )
    return stream, subject


async def test_publisher_stores_in_order_and_reports_duplicates(nc: NatsClient) -> None:
    js = nc.jetstream()
    stream, subject = await work_queue(nc)
    publisher = Publisher(js)
    first = await publisher.publish_all([Outgoing(subject, f"m{i}".encode(), f"id-{i}") for i in range(5)])
    assert first == [Stored(seq, False) for seq in range(1, 6)]
    # A duplicate answers with the sequence of the copy stored first.
    again = await publisher.publish_all([Outgoing(subject, b"late", "id-3"), Outgoing(subject, b"m5", "id-5")])
    assert again == [Stored(4, True), Stored(6, False)]
    assert await publisher.publish_all([]) == []
    info = await js.stream_info(stream)
    assert info.state.messages == 6
    stored = [(await js.get_msg(stream, seq)).data for seq in range(1, 7)]
    assert stored == [b"m0", b"m1", b"m2", b"m3", b"m4", b"m5"]


async def test_publisher_keeps_a_bounded_window_and_stores_everything_in_order(nc: NatsClient) -> None:
    js = nc.jetstream()
    stream, subject = await work_queue(nc)
    publisher = Publisher(js)
    in_flight: list[int] = []
    real_on_msg = publisher.on_msg

    async def on_msg(msg: Msg) -> None:
        in_flight.append(len(publisher._pending))
        await real_on_msg(msg)

    publisher.on_msg = on_msg  # type: ignore[method-assign]
    stored = await publisher.publish_all([Outgoing(subject, f"w{i}".encode(), f"w{i}") for i in range(100)], window=8)
    assert [s.seq for s in stored] == list(range(1, 101)) and not any(s.duplicate for s in stored)
    assert max(in_flight) <= 8 and len(in_flight) == 100
    assert (await js.stream_info(stream)).state.messages == 100


async def test_publisher_raises_what_the_server_refused(nc: NatsClient) -> None:
    js = nc.jetstream()
    stream, subject = await work_queue(nc, max_msg_size=100)
    publisher = Publisher(js)
    with pytest.raises(APIError) as refused:
        await publisher.publish_all([Outgoing(subject, b"small", "a"), Outgoing(subject, b"x" * 200, "b")])
    assert refused.value.code == 400 and "size" in str(refused.value.description)
    # The accepted one is stored; the refused one is not.
    assert (await js.stream_info(stream)).state.messages == 1
    with pytest.raises(NoStreamResponseError):
        await publisher.publish_all([Outgoing(f"nostream{next(_ids)}.x", b"lost", "c")])


async def pull_setup(nc: NatsClient) -> tuple[str, str, ConsumerConfig]:
    stream, subject = await work_queue(nc)
    return stream, subject, ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0, max_ack_pending=-1)


async def test_puller_returns_what_is_there_and_then_what_arrives(nc: NatsClient) -> None:
    js = nc.jetstream()
    stream, subject, config = await pull_setup(nc)
    publisher = Publisher(js)
    puller = await durable_puller(js, stream, subject, "workers", config)
    await publisher.publish_all([Outgoing(subject, f"a{i}".encode(), f"a{i}") for i in range(3)])
    # Three are there: a fetch of up to 64 returns them rather than waiting for more
    # (the guard only keeps a regression from hanging the suite).
    got = await asyncio.wait_for(puller.fetch(64, timeout_s=60.0), 20.0)
    assert [m.data for m in got] == [b"a0", b"a1", b"a2"]
    for m in got:
        await m.ack()

    # Nothing there: the fetch waits, and returns once a message comes.
    fetching = asyncio.create_task(puller.fetch(64, timeout_s=60.0))

    async def request_waiting() -> bool:
        return (await js.consumer_info(stream, "workers")).num_waiting >= 1

    await wait_until_async(request_waiting, 20, "the fetch's pull request to wait at the server")
    assert not fetching.done()
    await publisher.publish_all([Outgoing(subject, b"b0", "b0")])
    got = await asyncio.wait_for(fetching, 20.0)
    assert [m.data for m in got] == [b"b0"]
    await got[0].ack()

    with pytest.raises(asyncio.TimeoutError):
        await puller.fetch(8, timeout_s=0.3)
    # The durable was created with the given config, filtered to the subject.
    info = await js.consumer_info(stream, "workers")
    assert info.config.ack_policy == AckPolicy.EXPLICIT and info.config.filter_subject == subject


async def test_puller_takes_batches_and_buffers_the_rest(nc: NatsClient) -> None:
    js = nc.jetstream()
    stream, subject, config = await pull_setup(nc)
    publisher = Publisher(js)
    await publisher.publish_all([Outgoing(subject, f"m{i}".encode(), f"m{i}") for i in range(10)])
    puller = await durable_puller(js, stream, subject, "workers", config)
    seen: list[bytes] = []
    while len(seen) < 10:
        batch = await puller.fetch(4, timeout_s=5.0)
        assert 1 <= len(batch) <= 4
        seen += [m.data for m in batch]
        for m in batch:
            await m.ack()
    assert seen == [f"m{i}".encode() for i in range(10)]

    # Every message was acked exactly once: the work queue is empty.
    async def queue_empty() -> bool:
        return (await js.stream_info(stream)).state.messages == 0

    await wait_until_async(queue_empty, 10, "the acked work queue to empty")


async def test_puller_uses_an_existing_consumer_as_it_is(nc: NatsClient) -> None:
    js = nc.jetstream()
    stream, subject, config = await pull_setup(nc)
    await js.add_consumer(stream, ConsumerConfig(durable_name="workers", ack_policy=AckPolicy.EXPLICIT, ack_wait=7.0))
    await durable_puller(js, stream, subject, "workers", config)
    assert (await js.consumer_info(stream, "workers")).config.ack_wait == 7.0


async def test_puller_raises_when_its_consumer_is_gone(nc: NatsClient) -> None:
    js = nc.jetstream()
    stream, subject, config = await pull_setup(nc)
    puller = await durable_puller(js, stream, subject, "workers", config)
    await js.delete_consumer(stream, "workers")
    with pytest.raises(APIError):
        await puller.fetch(4, timeout_s=2.0)


def test_every_stream_takes_the_runs_replica_count() -> None:
    assert {c.num_replicas for c in stream_configs(Names("r"))} == {1}
    assert {c.num_replicas for c in stream_configs(Names("r", replicas=3))} == {3}


async def test_a_single_server_gets_one_replica_and_refuses_three(nc: NatsClient) -> None:
    """The replica count reaches the server: one is what a lone server holds, three it refuses."""
    js = nc.jetstream()
    single = Names(f"jspreplicas{next(_ids)}")
    await ensure_streams(js, single)
    infos = [await js.stream_info(c.name) for c in stream_configs(single)]
    assert len(infos) == 6 and {i.config.num_replicas for i in infos} == {1}
    kv = await ensure_bucket(js, single.policy_bucket, replicas=single.replicas)
    assert (await kv.status()).stream_info.config.num_replicas == 1
    with pytest.raises(APIError, match=r"(?i)replicas"):
        await ensure_streams(js, Names(f"jspreplicas{next(_ids)}", replicas=3))
    with pytest.raises(APIError, match=r"(?i)replicas"):
        await ensure_bucket(js, f"jspreplicas{next(_ids)}-policy", replicas=3)
