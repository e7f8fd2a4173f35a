"""The broker's message work with none of its logic: the floor under the broker's figure.

Owns the relay run of the broker benchmark (:mod:`benchmarks.broker`). A
group through the broker costs JetStream two round trips, where the raw
baseline makes one: a train task goes out (published, leased by a
generator, acked) and its group comes back (published, fetched, acked).
Here a relay process stands where the broker stands and does only that:
it keeps ``window`` tasks outstanding, each a pre-serialized train task
under its own id, and fetches and acks every group the moment it arrives,
through the broker's own publish and fetch paths and on the broker's
consumers. No ledger, no validation, no batching, no learner. The
generators are the broker run's fake generators, unchanged, in the harness
process; the rate is groups published per second over a window after
warm-up, with the CPU every process spent per group. Whatever rate the
relay reaches on a machine bounds what any broker on this message pattern
can reach there.

    python -m benchmarks.relay --nats URL --prefix P [--window N]

runs the relay side until SIGTERM (the benchmark starts it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig

from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names, ensure_streams
from asymptote.jetstream.publish import Outgoing, Publisher
from asymptote.jetstream.pull import durable_puller
from asymptote.nats_local import NatsServer
from benchmarks.harness import NUM_GENERATORS, CpuMeter, GeneratorCounts, fake_generator, start_module, stop_process

WINDOW = 256
"""Tasks issued and not yet answered, at most (the broker's outstanding limit plays this part)."""
FETCH_BATCH = 256
"""Groups per fetch: the broker's."""


def task_message(subject: str, base: bytes, index: int) -> Outgoing:
    """Train task ``index``: its id, then ``base`` (protobuf concatenation is a merge)."""
    task_id = f"train-e0-p{index}-{index:010d}"
    return Outgoing(subject, rollout_pb2.GenerationTask(task_id=task_id).SerializeToString() + base, task_id)


def base_task(group_size: int, max_tokens: int) -> bytes:
    """The part of every task that does not depend on its id."""
    return rollout_pb2.GenerationTask(
        kind=rollout_pb2.TASK_KIND_TRAIN,
        task_name="arithmetic",
        prompt_id="0000000000",
        prompt="037+485=",
        reference="522",
        sampling=rollout_pb2.SamplingParams(num_samples=group_size, temperature=1.0, top_p=1.0, max_tokens=max_tokens),
        issued_unix_s=time.time(),
    ).SerializeToString()


async def relay(nats_url: str, prefix: str, window: int, group_size: int, max_tokens: int) -> None:
    """Issue tasks and take groups until SIGTERM (see the module docstring)."""
    names = Names(prefix)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    nc = await nats.connect(nats_url, name="bench-relay")
    js = nc.jetstream()
    await ensure_streams(js, names)
    publisher = Publisher(js)
    base = base_task(group_size, max_tokens)
    answered = asyncio.Event()
    issued = acked = 0

    async def issue() -> None:
        nonlocal issued
        while not stop.is_set():
            room = window - (issued - acked)
            if room <= 0:
                answered.clear()
                await answered.wait()
                continue
            await publisher.publish_all(
                [task_message(names.train_tasks, base, i) for i in range(issued, issued + room)]
            )
            issued += room

    async def take() -> None:
        nonlocal acked
        puller = await durable_puller(
            js,
            names.rollouts_stream,
            names.rollouts,
            names.broker_consumer,
            ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0, max_ack_pending=-1),
        )
        while not stop.is_set():
            try:
                msgs = await puller.fetch(FETCH_BATCH, timeout_s=0.5)
            except TimeoutError:  # nats raises its subclass
                continue
            for msg in msgs:
                await msg.ack()
            acked += len(msgs)
            answered.set()

    workers = [asyncio.create_task(issue()), asyncio.create_task(take())]
    try:
        await stop.wait()
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await nc.close()


async def through_relay(
    server: NatsServer,
    workdir: Path,
    num_groups: int,
    warmup_s: float,
    run: int,
    group_size: int,
    max_tokens: int,
    window: int = WINDOW,
) -> dict[str, Any]:
    """One relay run on streams of its own (prefix ``relay<run>``): groups/s and CPU per group.

    The window opens ``warmup_s`` after the first group (and once 128 are
    in) and closes once ``num_groups`` more have been published.
    """
    prefix = f"relay{run}"
    log_path = workdir / f"relay{run}.log"
    workdir.mkdir(parents=True, exist_ok=True)
    args = ["--nats", server.url, "--prefix", prefix, "--window", str(window)]
    args += ["--group-size", str(group_size), "--max-tokens", str(max_tokens)]
    proc = start_module("benchmarks.relay", args, log_path)
    stop = asyncio.Event()
    counts = GeneratorCounts()
    names = Names(prefix)
    generators: list[asyncio.Task[None]] = []
    try:
        meter = CpuMeter({"relay": proc.pid, "nats-server": server.process.pid, "harness": os.getpid()})
        # The generators create their consumer once the relay has declared the streams.
        nc = await nats.connect(server.url, name="bench-relay-watch")
        try:
            deadline = time.monotonic() + 60.0
            while True:
                try:
                    await nc.jetstream().stream_info(names.tasks_stream)
                    break
                except Exception:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the relay did not declare its streams (see {log_path})") from None
                    await asyncio.sleep(0.1)
        finally:
            await nc.close()
        generators = [
            asyncio.create_task(fake_generator(server.url, names, i, stop, counts)) for i in range(NUM_GENERATORS)
        ]

        async def published(at_least: int) -> None:
            while counts.groups_published < at_least:
                for task in generators:
                    if task.done():
                        task.result()  # a generator that died says why
                counts.changed.clear()
                await counts.changed.wait()

        await asyncio.wait_for(published(1), 60.0)
        first = time.perf_counter()
        await asyncio.wait_for(published(128), 60.0)
        await asyncio.sleep(max(0.0, warmup_s - (time.perf_counter() - first)))  # warm-up: a duration, not an event
        meter.start()
        start_count, started = counts.groups_published, time.perf_counter()
        await asyncio.wait_for(published(start_count + num_groups), 120.0)
        window_s = time.perf_counter() - started
        meter.stop()
        groups = counts.groups_published - start_count
        return {
            "groups": groups,
            "window_s": window_s,
            "groups_per_s": groups / window_s,
            "cpu_us_per_group": meter.per_group_us(groups),
            "tasks_per_fetch": counts.tasks_leased / max(counts.fetches, 1),
        }
    finally:
        stop.set()
        await asyncio.gather(*generators, return_exceptions=True)
        stop_process(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nats", required=True, help="nats-server URL")
    parser.add_argument("--prefix", required=True, help="names of this run's streams")
    parser.add_argument("--window", type=int, default=WINDOW, help="tasks outstanding at most")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    asyncio.run(relay(args.nats, args.prefix, args.window, args.group_size, args.max_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
