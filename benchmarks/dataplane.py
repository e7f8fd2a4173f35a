"""The data plane under load, with no model: simulated generators and learner against one real broker.

Owns the simulated fleet that :mod:`benchmarks.scale` measures, and the
broker process it runs against (``asymptote broker``, one process, on one
real nats-server). Each simulated generator is a light asyncio client with a
NATS connection of its own that acts toward the broker as
``services/generator/rollout.py`` does: it leases tasks from the shared
durable consumer, keeps ``inflight_per_generator`` groups in flight, spends
``generate_s`` on each (its policy version read at the start and at the
end, so a group sampled across a weight swap carries two version spans),
publishes a ``RolloutGroup`` built with the project's messages under the
task id, and acks the task only once the group is stored. Told to stop, it
hands back the tasks it has not started (nak with the generator's delay)
and finishes the ones in flight; killed, it drops its connection with
everything it holds, which JetStream redelivers after the lease. The
simulated learner pulls batches through the broker's real ``NextBatch`` and
``Ack`` over gRPC, spends ``step_s`` on each step, bumps its version, and
acks each batch after its step (retrying across a broker restart, as the
learner does). Like the learner, it remembers the groups it trained: a
copy served again (redelivered after a broker restart, before the ack of
its first batch landed) is named a duplicate in the ack and kept out of
the step, never trained twice. Knows nothing of sweeps or reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from asymptote.config import ListenSettings, NatsSettings
from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc
from asymptote.jetstream.names import Names, ensure_bucket
from asymptote.jetstream.publish import Outgoing, Publisher
from asymptote.jetstream.pull import durable_puller
from asymptote.ledger import Audit, audit
from asymptote.messages import decode_task
from asymptote.nats_local import free_port
from asymptote.policy import publish_policy
from asymptote.rpc import channel
from benchmarks.broker import broker_status, next_batch, start_broker
from services.broker.config import BrokerConfig, EvalSettings, SamplingSettings

log = logging.getLogger(__name__)

HAND_BACK_DELAY_S = 1.5
"""A stopping generator's redelivery delay for the tasks it never started (the generator's own)."""


@dataclass(frozen=True)
class LoadShape:
    """What the simulated fleet generates and how the simulated learner consumes it."""

    group_size: int = 8
    """G: completions per group."""
    completion_tokens: int = 128
    """Tokens per completion (with a log-prob each)."""
    prompt_tokens: int = 64
    """Tokens of each group's prompt."""
    inflight_per_generator: int = 4
    """Groups a generator keeps in flight."""
    generate_s: float = 0.2
    """Mean seconds a group takes to generate (drawn uniformly within +-50%)."""
    batch_prompts: int = 128
    """B: groups per learner batch."""
    step_s: float = 0.02
    """Seconds the learner computes per step."""
    staleness_versions: int = 32
    """k: the broker drops groups more than k versions behind (k versions pass every k * B groups)."""
    task_ack_wait_s: float = 5.0
    """The generators' lease on a task: a dead generator's tasks come back after it."""
    broker_ack_wait_s: float = 10.0
    """The broker's lease on a group: a dead broker's held groups come back after it."""

    def offered_groups_per_s(self, num_generators: int) -> float:
        """Groups per second the generators can produce when nothing else holds them back."""
        return num_generators * self.inflight_per_generator / self.generate_s


@dataclass
class FleetCounts:
    tasks_leased: int = 0
    redelivered_tasks: int = 0
    """Leases of a task that had been delivered before (a dead generator's, or a lapsed lease)."""
    groups_published: int = 0
    duplicates_published: int = 0
    handed_back: int = 0
    eval_tasks: int = 0
    publish_failures: int = 0


class Completions:
    """Serialized completions per (start version, end version): built once, with the project's messages.

    A group's own fields are serialized apart and the two parts
    concatenated (protobuf concatenation is a merge), so the fleet spends
    its time on the protocol, not on rebuilding identical token lists.
    """

    def __init__(self, shape: LoadShape) -> None:
        self.shape = shape
        self._cache: dict[tuple[int, int], bytes] = {}
        n = shape.completion_tokens
        self._tokens = [4 + (j * 7) % 250 for j in range(n)]
        self._logprobs = [-0.02 - 0.001 * (j % 50) for j in range(n)]
        self._prompt = [1] + [4 + j % 250 for j in range(shape.prompt_tokens - 1)]

    def get(self, start_version: int, end_version: int) -> bytes:
        key = (start_version, end_version)
        data = self._cache.get(key)
        if data is None:
            if len(self._cache) > 64:
                self._cache.clear()
            n = self.shape.completion_tokens
            if end_version > start_version:  # swapped mid-sequence: the new version took the second half
                spans = [
                    rollout_pb2.VersionSpan(version=start_version, start=0, end=n // 2),
                    rollout_pb2.VersionSpan(version=end_version, start=n // 2, end=n),
                ]
            else:
                spans = [rollout_pb2.VersionSpan(version=start_version, start=0, end=n)]
            data = self._cache[key] = rollout_pb2.RolloutGroup(
                prompt_token_ids=self._prompt,
                completions=[
                    rollout_pb2.Completion(
                        token_ids=self._tokens,
                        logprobs=self._logprobs,
                        version_spans=spans,
                        reward=float(i % 2),
                        finish_reason="stop",
                    )
                    for i in range(self.shape.group_size)
                ],
                min_version=start_version,
                max_version=end_version,
            ).SerializeToString()
        return data


class SimGenerator:
    """One simulated generator (see the module docstring)."""

    def __init__(
        self, index: int, nats_url: str, names: Names, shape: LoadShape, learner: SimLearner, counts: FleetCounts
    ) -> None:
        self.generator_id = f"sim-generator-{index}"
        self.nats_url = nats_url
        self.names = names
        self.shape = shape
        self.learner = learner
        self.counts = counts
        self.completions = Completions(shape)
        self._stop = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()
        self._nc: NatsClient | None = None
        self._runner: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._stop.clear()
        self._runner = asyncio.create_task(self._run(), name=self.generator_id)

    async def _run(self) -> None:
        nc = self._nc = await nats.connect(self.nats_url, name=self.generator_id, max_reconnect_attempts=-1)
        js = nc.jetstream()
        publisher = Publisher(js)
        puller = await durable_puller(
            js,
            self.names.tasks_stream,
            self.names.all_tasks,
            self.names.generators_consumer,
            ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT, ack_wait=self.shape.task_ack_wait_s, max_deliver=5, max_ack_pending=-1
            ),
        )
        while not self._stop.is_set():
            room = self.shape.inflight_per_generator - len(self._inflight)
            if room <= 0:
                await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                msgs = await puller.fetch(room, timeout_s=0.5)
            except TimeoutError:  # nats raises its subclass, or asyncio's own
                continue
            except Exception as exc:  # the server or the stream restarting: lease again shortly
                log.debug("%s: fetch failed: %s", self.generator_id, exc)
                await asyncio.sleep(0.2)
                continue
            for msg in msgs:
                if self._stop.is_set():  # told to stop meanwhile: hand it back
                    await msg.nak(delay=HAND_BACK_DELAY_S)
                    self.counts.handed_back += 1
                    continue
                task = asyncio.create_task(self._generate(msg, publisher))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)

    async def _generate(self, msg: Msg, publisher: Publisher) -> None:
        self.counts.tasks_leased += 1
        if msg.metadata.num_delivered > 1:
            self.counts.redelivered_tasks += 1
        task = decode_task(msg.data)
        if task.kind != rollout_pb2.TASK_KIND_TRAIN:
            self.counts.eval_tasks += 1  # nothing consumes eval results here
            await msg.ack()
            return
        started, start_version = time.time(), self.learner.version
        await asyncio.sleep(self.shape.generate_s * random.uniform(0.5, 1.5))
        end_version = self.learner.version
        head = rollout_pb2.RolloutGroup(
            group_id=task.task_id,
            task=task,
            generator_id=self.generator_id,
            started_unix_s=started,
            finished_unix_s=time.time(),
        ).SerializeToString()
        payload = head + self.completions.get(start_version, end_version)
        try:
            (stored,) = await publisher.publish_all([Outgoing(self.names.rollouts, payload, task.task_id)])
        except Exception as exc:  # the group is not stored: the task goes back, as the generator does
            self.counts.publish_failures += 1
            log.debug("%s: publish of %s failed: %s", self.generator_id, task.task_id, exc)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        self.counts.groups_published += 1
        self.counts.duplicates_published += stored.duplicate
        await msg.ack()

    async def stop(self) -> None:
        """Stop leasing, finish what is in flight, hand back nothing left unstarted; close."""
        self._stop.set()
        if self._runner is not None:
            await asyncio.wait([self._runner], timeout=2.0)
            self._runner.cancel()
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=30.0)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
        self._nc = None

    async def kill(self) -> None:
        """Die: drop everything held, with no ack, nak or publish (JetStream redelivers after the lease)."""
        self._stop.set()
        tasks = [t for t in [self._runner, *self._inflight] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
        self._nc = None


@dataclass
class Step:
    """One learner step: when its batch arrived, how long the learner waited for it, its size."""

    at_s: float
    wait_s: float
    num_groups: int


@dataclass
class SimLearner:
    """The simulated learner (see the module docstring)."""

    endpoint: str
    shape: LoadShape
    version: int = 0
    steps: list[Step] = field(default_factory=list)
    num_acked: int = 0
    ack_failures: int = 0
    trained_ids: set[str] = field(default_factory=set)
    """Every group trained (the learner keeps the newest 200,000 in its checkpoint; a run here holds fewer)."""
    _pending_acks: list[services_pb2.AckedBatch] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        async with channel(self.endpoint) as ch:
            stub = services_pb2_grpc.BrokerStub(ch)
            while not stop.is_set():
                # The wait runs from the end of the last step to a batch, over empty answers and a broker away.
                asked = time.monotonic()
                got = None
                while got is None and not stop.is_set():
                    got = await self._next_batch(stub)
                if got is None:
                    break
                batch_id, group_ids = got
                # As the learner does: a redelivered copy of a group it trained (a broker restart before its
                # ack landed) is named a duplicate and kept out of the step; a batch of nothing else is no step.
                dups = [g for g in group_ids if g in self.trained_ids]
                self.trained_ids.update(group_ids)
                self._pending_acks.append(
                    services_pb2.AckedBatch(batch_id=batch_id, group_ids=group_ids, duplicate_group_ids=dups)
                )
                if len(dups) < len(group_ids):
                    arrived = time.monotonic()
                    self.steps.append(Step(arrived, arrived - asked, len(group_ids) - len(dups)))
                    await asyncio.sleep(self.shape.step_s)  # the step's compute
                    self.version += 1
                await self._ack(stub)
            await self._ack(stub)

    async def _next_batch(self, stub: services_pb2_grpc.BrokerStub) -> tuple[str, list[str]] | None:
        try:
            return await next_batch(stub, self.shape.batch_prompts, self.version, timeout_s=1.0, rpc_timeout_s=10.0)
        except grpc.aio.AioRpcError as exc:  # the broker is down or restarting: ask again shortly
            log.debug("NextBatch failed: %s", exc.code())
            await asyncio.sleep(0.1)
            return None

    async def _ack(self, stub: services_pb2_grpc.BrokerStub) -> None:
        """Ack every batch trained and not acked yet; kept for the next step if the broker is away."""
        if not self._pending_acks:
            return
        try:
            resp = await stub.Ack(services_pb2.AckRequest(batches=self._pending_acks), timeout=10.0)
        except grpc.aio.AioRpcError:
            self.ack_failures += 1
            return
        self.num_acked += sum(len(b.group_ids) for b in self._pending_acks)
        del resp
        self._pending_acks = []

    def window(self, start_s: float, end_s: float) -> list[Step]:
        return [s for s in self.steps if start_s <= s.at_s < end_s]


class BrokerProcess:
    """One ``asymptote broker`` process on a fixed gRPC port, which a restart keeps."""

    def __init__(self, nats_url: str, names: Names, shape: LoadShape, workdir: Path) -> None:
        self.names = names
        self.workdir = workdir
        self.config = BrokerConfig(
            nats=NatsSettings(url=nats_url),
            prefix=names.prefix,
            grpc=ListenSettings(port=free_port()),
            http=ListenSettings(port=free_port()),
            sampling=SamplingSettings(group_size=shape.group_size, max_tokens=shape.completion_tokens),
            eval=EvalSettings(every_versions=1_000_000, num_prompts=1),
            batch_prompts=shape.batch_prompts,
            max_staleness_versions=shape.staleness_versions,
            ack_wait_s=shape.broker_ack_wait_s,
            log_format="text",
        )
        self.endpoint = f"127.0.0.1:{self.config.grpc.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> int:
        """Start it and wait (up to 60 s) until it answers; its pid."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = start_broker(self.config, self.workdir)
        await self.status()
        return self.proc.pid

    async def status(self) -> dict[str, float]:
        assert self.proc is not None
        return await broker_status(self.endpoint, self.proc, self.workdir / "broker.log")

    def kill(self) -> None:
        """SIGKILL its process group, as a node losing the pod would."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


async def announce_first_version(nats_url: str, names: Names) -> None:
    """The learner's version 0 in the policy bucket: the broker issues train tasks once it is there."""
    nc = await nats.connect(nats_url, name="sim-learner-policy")
    try:
        kv = await ensure_bucket(nc.jetstream(), names.policy_bucket)
        await publish_policy(
            kv,
            names,
            rollout_pb2.PolicyVersion(version=0, weights_endpoint="sim:0", digest="00", published_unix_s=time.time()),
        )
    finally:
        await nc.close()


async def audit_run(nats_url: str, names: Names) -> Audit:
    nc = await nats.connect(nats_url, name="sim-audit")
    try:
        return await audit(nc.jetstream(), names)
    finally:
        await nc.close()


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def step_figures(steps: list[Step], window_s: float) -> dict[str, Any]:
    """Groups/s, NextBatch latency percentiles and the learner's wait fraction over a window of steps."""
    waits = [s.wait_s for s in steps]
    return {
        "groups_per_s": sum(s.num_groups for s in steps) / window_s,
        "steps": len(steps),
        "next_batch_p50_ms": 1000 * percentile(waits, 0.5),
        "next_batch_p99_ms": 1000 * percentile(waits, 0.99),
        "learner_wait_fraction": min(1.0, sum(waits) / window_s),
    }
