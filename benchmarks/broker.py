"""Groups per second through the broker against raw nats-py on the same server.

Owns the broker-throughput benchmark. One real nats-server with JetStream
serves both sides, measured in one run:

- through the broker: the real broker service as its own process
  (``asymptote broker``), with this process playing the learner and the
  generators. Fake generators lease train tasks from the work queue as
  ``services/generator/rollout.py`` does and at once publish a valid
  ``RolloutGroup`` (G completions, half the rewards 1, so none is filtered);
  a fake learner takes batches over real gRPC (``Broker.NextBatch``, groups
  packed, as the learner asks for them) and acks each at once
  (``Broker.Ack``). The rate is groups delivered to the
  learner per second over a window after warm-up, so it covers issuing,
  ledger records, admission, batching and acks. The fakes share this
  process with each other (and the machine with the broker and the
  server), so they are kept cheap, to measure the broker rather than
  them: groups are built from pre-serialized completions, published and
  leased with the broker's own JetStream paths (``asymptote.jetstream``),
  and the learner sends each Ack alongside its next NextBatch.
- raw: the same serialized group published N times into a stream shaped
  like the rollouts stream, fetched by a durable pull consumer in batches
  with explicit acks, concurrently; groups/s = N / wall time.

- relay (:mod:`benchmarks.relay`): the broker's message work with none of
  its logic, after each broker run, with the same fake generators: what
  any broker on this message pattern could reach here.

The learner takes batches of ``BATCH_PROMPTS`` prompts (96: ScaleRL's 768
completions at G = 8); the broker issues tasks as batches are taken, so
this is also the size of the chunks tasks are issued and leased in.
Raw and broker runs alternate (raw, broker, raw, broker, raw, broker, raw;
one broker run in quick mode), each broker run with a fresh broker and
streams of its own. A round's ratio is its broker rate over the mean of
the raw runs either side of it, so a machine that slows down or speeds up
during the benchmark moves both; the figure is the median round. Each run
also counts the CPU seconds every process spent per group (the broker,
nats-server, and this process playing the generators and the learner), which
says what a rate on this machine is bounded by.

    python -m benchmarks.broker --output DIR [--quick] [--batch-prompts N]

Target: broker rate / raw rate >= 0.5, and >= 5,000 groups/s.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig

from asymptote.config import ListenSettings, NatsSettings, dump_config
from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc
from asymptote.jetstream.names import Names, ensure_bucket, stream_configs
from asymptote.nats_local import NatsServer, free_port, start_nats
from asymptote.policy import publish_policy
from asymptote.rpc import channel
from benchmarks.figure import Figure, Target
from benchmarks.harness import (
    FETCH_BATCH,
    GROUP_SIZE,
    NUM_COMPLETION_TOKENS,
    NUM_GENERATORS,
    CpuMeter,
    GeneratorCounts,
    fake_generator,
    start_module,
    stop_process,
    synthetic_completions,
    synthetic_group,
)
from benchmarks.relay import through_relay
from services.broker.config import BrokerConfig, EvalSettings, SamplingSettings

TARGET_RATIO = 0.5
TARGET_GROUPS_PER_S = 5000.0
BENCH_FILE_NAME = "broker_bench.json"
PREFIX = "bench"
ROUNDS = 3
"""Broker runs in the full benchmark, each between two raw runs."""
BATCH_PROMPTS = 96
"""Prompts per learner batch: 768 completions at G = 8, ScaleRL's batch (48 prompts x 16)."""


def sample_payload() -> bytes:
    """A serialized group as the broker run carries them (the raw baseline's message)."""
    task = rollout_pb2.GenerationTask(
        task_id="train-e0-p0-0000000000",
        kind=rollout_pb2.TASK_KIND_TRAIN,
        task_name="arithmetic",
        prompt_id="0000000000",
        prompt="037+485=",
        reference="225",
        sampling=rollout_pb2.SamplingParams(
            num_samples=GROUP_SIZE, temperature=1.0, top_p=1.0, max_tokens=NUM_COMPLETION_TOKENS
        ),
        issued_unix_s=time.time(),
    )
    return synthetic_group(task, "bench-generator-0", synthetic_completions())


# -- the raw nats-py baseline ---------------------------------------------------


async def raw_groups_per_s(
    nats_url: str, payload: bytes, num_groups: int, run: int, meter: CpuMeter | None = None
) -> float:
    """Publish ``payload`` ``num_groups`` times and fetch them back, concurrently; groups per second.

    ``meter``, if given, is read at the start and the end of the transfer.
    """
    names = Names(f"raw{run}")
    config = next(c for c in stream_configs(names) if c.name == names.rollouts_stream)
    pub_nc = await nats.connect(nats_url, name=f"bench-raw-publisher-{run}")
    sub_nc = await nats.connect(nats_url, name=f"bench-raw-consumer-{run}")
    pub_js, sub_js = pub_nc.jetstream(), sub_nc.jetstream()
    try:
        await pub_js.add_stream(config)
        sub = await sub_js.pull_subscribe(
            names.rollouts,
            durable=names.broker_consumer,
            stream=names.rollouts_stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0, max_ack_pending=-1),
        )

        async def produce() -> None:
            for start in range(0, num_groups, FETCH_BATCH):
                await asyncio.gather(
                    *(
                        pub_js.publish(names.rollouts, payload, headers={"Nats-Msg-Id": f"raw-{i}"})
                        for i in range(start, min(num_groups, start + FETCH_BATCH))
                    )
                )

        async def consume() -> None:
            got = 0
            while got < num_groups:
                try:
                    msgs = await sub.fetch(batch=FETCH_BATCH, timeout=0.5)
                except TimeoutError:  # nats raises its subclass
                    continue
                for m in msgs:
                    await m.ack()
                got += len(msgs)

        if meter is not None:
            meter.start()
        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(produce(), consume()), timeout=120.0)
        wall = time.perf_counter() - started
        if meter is not None:
            meter.stop()
        await pub_js.delete_stream(names.rollouts_stream)
        return num_groups / wall
    finally:
        await pub_nc.close()
        await sub_nc.close()


# -- through the broker -----------------------------------------------------------


async def next_batch(
    stub: services_pb2_grpc.BrokerStub,
    num_groups: int,
    learner_version: int = 0,
    timeout_s: float = 5.0,
    rpc_timeout_s: float = 35.0,
) -> tuple[str, list[str]] | None:
    """One Broker.NextBatch as the learner calls it (groups packed): (batch id, group ids), None on timeout."""
    header, group_ids = None, []
    request = services_pb2.NextBatchRequest(
        learner_version=learner_version, num_groups=num_groups, timeout_s=timeout_s, packed=True
    )
    async for part in stub.NextBatch(request, timeout=rpc_timeout_s):
        kind = part.WhichOneof("part")
        if kind == "header":
            header = part.header
        elif kind == "groups":
            group_ids += [g.group_id for g in part.groups.groups]
        else:
            group_ids.append(part.group.group_id)
    if header is None or not header.batch_id:
        return None
    if len(group_ids) != header.num_groups:
        raise RuntimeError(f"batch {header.batch_id}: header says {header.num_groups} groups, got {len(group_ids)}")
    return header.batch_id, group_ids


async def fake_learner(
    endpoint: str,
    batch_prompts: int,
    num_groups: int,
    warmup_s: float,
    deadline_s: float,
    meter: CpuMeter | None = None,
) -> tuple[int, float, int]:
    """Take batches and ack each at once; returns (groups in the window, window seconds, warm-up groups).

    Each batch's Ack is sent as soon as the batch is in, alongside the request
    for the next batch rather than before it (the learner acks after its
    checkpoints, not between a batch and the next request), with at most two
    Acks in flight; the window closes once every Ack returned. Warm-up lasts
    ``warmup_s`` from the first batch (and at least four batches), so the
    broker's outstanding limit has measured the flow; the window then counts
    exactly ``num_groups`` (a multiple of the batch size). ``meter``, if
    given, is read when the window opens and when it closes.
    """
    deadline = time.monotonic() + deadline_s
    async with channel(endpoint) as ch:
        stub = services_pb2_grpc.BrokerStub(ch)
        acks: set[asyncio.Task[None]] = set()

        async def ack(batch_id: str, group_ids: list[str]) -> None:
            batch = services_pb2.AckedBatch(batch_id=batch_id, group_ids=group_ids)
            await stub.Ack(services_pb2.AckRequest(batches=[batch]), timeout=10.0)

        async def settle(keep: int) -> None:
            while len(acks) > keep:
                done, _ = await asyncio.wait(acks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    acks.discard(task)
                    task.result()  # an Ack that failed fails the benchmark

        delivered, first_s, window_start, warmup_groups = 0, None, None, 0
        try:
            while window_start is None or delivered - warmup_groups < num_groups:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the learner got {delivered} groups in {deadline_s:.0f}s")
                got = await next_batch(stub, batch_prompts)
                if got is None:
                    continue
                batch_id, group_ids = got
                await settle(keep=1)
                acks.add(asyncio.create_task(ack(batch_id, group_ids)))
                delivered += len(group_ids)
                now = time.perf_counter()
                first_s = first_s or now
                if window_start is None and now - first_s >= warmup_s and delivered >= 4 * batch_prompts:
                    await settle(keep=0)  # the window starts with no Ack of the warm-up in flight
                    if meter is not None:
                        meter.start()
                    window_start, warmup_groups = time.perf_counter(), delivered
            await settle(keep=0)
            if meter is not None:
                meter.stop()
        finally:
            for task in acks:
                task.cancel()
        return delivered - warmup_groups, time.perf_counter() - window_start, warmup_groups


def broker_config(nats_url: str, batch_prompts: int, prefix: str = PREFIX) -> BrokerConfig:
    return BrokerConfig(
        nats=NatsSettings(url=nats_url),
        prefix=prefix,
        grpc=ListenSettings(port=free_port()),
        http=ListenSettings(port=free_port()),
        sampling=SamplingSettings(group_size=GROUP_SIZE, max_tokens=NUM_COMPLETION_TOKENS),
        eval=EvalSettings(every_versions=1_000_000, num_prompts=1),
        batch_prompts=batch_prompts,
        log_format="text",
    )


def start_broker(config: BrokerConfig, workdir: Path) -> subprocess.Popen[bytes]:
    path = workdir / "broker.yaml"
    dump_config(config, path)
    return start_module("services.cli", ["broker", "--config", str(path)], workdir / "broker.log")


async def broker_status(endpoint: str, broker: subprocess.Popen[bytes], log_path: Path) -> dict[str, float]:
    """The broker's Status gauges, waiting (up to 60 s) for it to answer."""
    deadline = time.monotonic() + 60.0
    async with channel(endpoint) as ch:
        stub = services_pb2_grpc.BrokerStub(ch)
        while True:
            if broker.poll() is not None:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"the broker exited with {broker.returncode}:\n{tail}")
            try:
                return dict((await stub.Status(services_pb2.StatusRequest(), timeout=2.0)).gauges)
            except Exception:  # not listening yet
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


async def through_broker(
    server: NatsServer, workdir: Path, batch_prompts: int, num_groups: int, warmup_s: float, run: int = 0
) -> dict[str, Any]:
    """One broker run: a fresh broker on streams of its own (prefix ``bench<run>``), measured over a window."""
    prefix = f"{PREFIX}{run}"
    config = broker_config(server.url, batch_prompts, prefix)
    names = Names(prefix)
    endpoint = f"127.0.0.1:{config.grpc.port}"
    workdir = workdir / f"run{run}"
    workdir.mkdir(parents=True, exist_ok=True)
    broker = start_broker(config, workdir)
    stop = asyncio.Event()
    generators: list[asyncio.Task[None]] = []
    nc: NatsClient | None = None
    try:
        await broker_status(endpoint, broker, workdir / "broker.log")
        nc = await nats.connect(server.url, name="bench-learner")
        kv = await ensure_bucket(nc.jetstream(), names.policy_bucket)
        # The broker issues train tasks once the learner has announced a version.
        await publish_policy(
            kv,
            names,
            rollout_pb2.PolicyVersion(version=0, weights_endpoint="bench:0", digest="00", published_unix_s=time.time()),
        )
        counts = GeneratorCounts()
        generators = [
            asyncio.create_task(fake_generator(server.url, names, i, stop, counts)) for i in range(NUM_GENERATORS)
        ]
        meter = CpuMeter({"broker": broker.pid, "nats-server": server.process.pid, "harness": os.getpid()})
        learner = asyncio.create_task(
            fake_learner(endpoint, batch_prompts, num_groups, warmup_s, deadline_s=300.0, meter=meter)
        )
        done, _ = await asyncio.wait([learner, *generators], return_when=asyncio.FIRST_COMPLETED)
        if learner not in done:  # a generator died: its exception says why
            learner.cancel()
            for t in done:
                t.result()
        groups, window_s, warmup_groups = learner.result()
        gauges = await broker_status(endpoint, broker, workdir / "broker.log")
        return {
            "groups": groups,
            "window_s": window_s,
            "groups_per_s": groups / window_s,
            "warmup_groups": warmup_groups,
            "batch_prompts": batch_prompts,
            "group_size": GROUP_SIZE,
            "num_generators": NUM_GENERATORS,
            "tasks_issued": int(gauges.get("tasks_issued", 0)),
            "groups_received": int(gauges.get("groups_received", 0)),
            "groups_admitted": int(gauges.get("groups_received", 0))
            - int(sum(v for k, v in gauges.items() if k.startswith("dropped_"))),
            "groups_dropped": {
                k.removeprefix("dropped_"): int(v) for k, v in gauges.items() if k.startswith("dropped_")
            },
            "groups_served": int(gauges.get("groups_served", 0)),
            "groups_trained": int(gauges.get("groups_trained", 0)),
            "generator_tasks_leased": counts.tasks_leased,
            "generator_groups_published": counts.groups_published,
            "generator_duplicates": counts.duplicates,
            "tasks_per_fetch": counts.tasks_leased / max(counts.fetches, 1),
            "cpu_us_per_group": meter.per_group_us(groups),
        }
    finally:
        stop.set()
        if generators:
            await asyncio.gather(*generators, return_exceptions=True)
        if nc is not None:
            await nc.close()
        stop_process(broker)


async def measure(workdir: Path, quick: bool, batch_prompts: int = BATCH_PROMPTS) -> dict[str, Any]:
    """Raw, broker and relay runs (``ROUNDS`` rounds, one in quick mode, with batches of 16), on one nats-server."""
    num_groups, warmup_s, rounds = (800, 1.0, 1) if quick else (12000, 2.0, ROUNDS)
    if quick:
        batch_prompts = 16
    num_groups -= num_groups % batch_prompts
    shutil.rmtree(workdir / "nats", ignore_errors=True)
    server = start_nats(workdir / "nats")
    raws: list[dict[str, Any]] = []
    brokers: list[dict[str, Any]] = []
    relays: list[dict[str, Any]] = []
    try:
        payload = sample_payload()

        async def raw(run: int) -> None:
            meter = CpuMeter({"nats-server": server.process.pid, "harness": os.getpid()})
            rate = await raw_groups_per_s(server.url, payload, num_groups, run, meter)
            raws.append({"groups_per_s": rate, "cpu_us_per_group": meter.per_group_us(num_groups)})

        await raw(0)
        for run in range(rounds):
            brokers.append(await through_broker(server, workdir, batch_prompts, num_groups, warmup_s, run))
            relays.append(
                await through_relay(server, workdir, num_groups, warmup_s, run, GROUP_SIZE, NUM_COMPLETION_TOKENS)
            )
            await raw(run + 1)
    finally:
        server.stop()
    return {"brokers": brokers, "relays": relays, "raws": raws, "payload_bytes": len(payload)}


def cores_at(rate: float, cpu_us_per_group: dict[str, float]) -> float:
    """Cores the processes would keep busy at ``rate`` groups/s, at the CPU per group measured."""
    return rate * sum(cpu_us_per_group.values()) / 1e6


def bench_broker(quick: bool = False, workdir: Path | None = None, batch_prompts: int = BATCH_PROMPTS) -> Figure:
    """The broker's figure (see the module docstring): groups/s through the broker against raw nats-py.

    The details hold every round (with its relay run: the broker's message
    work alone, see :mod:`benchmarks.relay`), the raw rates, the CPU per
    group, the window, and the median round's broker and fake-generator
    counters. ``quick``: one round, batches of 16 and 800 measured groups
    instead of three rounds of ``batch_prompts`` and 12,000.
    """
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="broker-bench-") as tmp:
            return bench_broker(quick, Path(tmp), batch_prompts)
    workdir.mkdir(parents=True, exist_ok=True)
    m = asyncio.run(measure(workdir, quick, batch_prompts))
    raws = [r["groups_per_s"] for r in m["raws"]]
    either_side = [(before + after) / 2 for before, after in itertools.pairwise(raws)]
    rounds = [
        {
            **b,
            "raw_groups_per_s": base,
            "ratio": b["groups_per_s"] / base,
            "relay_groups_per_s": relay["groups_per_s"],
            "relay_cpu_us_per_group": relay["cpu_us_per_group"],
        }
        for b, relay, base in zip(m["brokers"], m["relays"], either_side, strict=True)
    ]
    # The median round (by ratio) is the figure: its rate, its raw baseline, its counts.
    b = sorted(rounds, key=lambda r: r["ratio"])[len(rounds) // 2]
    rate, raw = b["groups_per_s"], b["raw_groups_per_s"]
    dropped = sum(b["groups_dropped"].values())
    cpu = b["cpu_us_per_group"]
    raw_cpu = {
        name: statistics.mean(r["cpu_us_per_group"][name] for r in m["raws"])
        for name in m["raws"][0]["cpu_us_per_group"]
    }
    relay_rate = statistics.median(r["relay_groups_per_s"] for r in rounds)
    relay_cpu = {
        name: statistics.median(r["relay_cpu_us_per_group"][name] for r in rounds)
        for name in rounds[0]["relay_cpu_us_per_group"]
    }

    def cpu_text(us: dict[str, float]) -> str:
        return ", ".join(f"{name} {v:.0f}" for name, v in us.items())

    ratios_text = ", ".join(f"{r['ratio']:.2f}" for r in rounds)
    return Figure(
        name="broker_groups_per_s_vs_raw_nats",
        value=rate,
        unit="groups/s",
        ratio=b["ratio"],
        baseline=(
            f"raw nats-py publish+fetch {raw:,.0f} groups/s either side of the run (same server, "
            f"{m['payload_bytes']:,}-byte groups; {sum(raw_cpu.values()):.0f} us CPU per group)"
        ),
        measured=(
            f"through the broker {rate:,.0f} groups/s, the median of {len(rounds)} "
            f"(ratios {ratios_text}); {b['groups']:,} groups in "
            f"{b['window_s']:.2f} s after {b['warmup_groups']:,} warm-up; batches of {b['batch_prompts']}, "
            f"G={b['group_size']}; {b['tasks_issued']:,} tasks issued, {b['groups_admitted']:,} admitted, "
            f"{dropped} dropped; CPU per group (us): {cpu_text(cpu)}, so "
            f"{TARGET_GROUPS_PER_S:,.0f} groups/s would keep {cores_at(TARGET_GROUPS_PER_S, cpu):.1f} cores busy "
            f"(this machine has {os.cpu_count()}). The same message work with no broker logic (relay): "
            f"{relay_rate:,.0f} groups/s, CPU per group (us): {cpu_text(relay_cpu)}"
        ),
        targets=(
            Target(of="ratio", direction="at least", bound=TARGET_RATIO),
            Target(of="value", direction="at least", bound=TARGET_GROUPS_PER_S),
        ),
        details={
            "raw_groups_per_s": raw,
            "raw_groups_per_s_each": raws,
            "raw_cpu_us_per_group": raw_cpu,
            "relay_groups_per_s": relay_rate,
            "relay_cpu_us_per_group": relay_cpu,
            "payload_bytes": m["payload_bytes"],
            "rounds": [
                {
                    k: r[k]
                    for k in (
                        "groups_per_s",
                        "raw_groups_per_s",
                        "ratio",
                        "cpu_us_per_group",
                        "tasks_per_fetch",
                        "relay_groups_per_s",
                        "relay_cpu_us_per_group",
                    )
                }
                for r in rounds
            ],
            "cores_at_target": cores_at(TARGET_GROUPS_PER_S, cpu),
            "cpu_count": os.cpu_count(),
            **{
                k: v
                for k, v in b.items()
                if k
                not in ("groups_per_s", "raw_groups_per_s", "ratio", "relay_groups_per_s", "relay_cpu_us_per_group")
            },
        },
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.broker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME} and the logs")
    parser.add_argument("--quick", action="store_true", help="smaller batches and fewer groups (for CI)")
    parser.add_argument(
        "--batch-prompts", type=int, default=BATCH_PROMPTS, help=f"prompts per learner batch (default {BATCH_PROMPTS})"
    )
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    figure = bench_broker(args.quick, args.output / "broker-bench", args.batch_prompts)
    (args.output / BENCH_FILE_NAME).write_text(json.dumps(figure.as_json(), indent=2) + "\n")
    print(
        f"broker: {figure.value:,.0f} groups/s vs raw nats-py {figure.details['raw_groups_per_s']:,.0f} "
        f"= {figure.ratio:.3f}x (target {figure.target}; {figure.verdict})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
