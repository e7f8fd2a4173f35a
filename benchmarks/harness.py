"""What the data-plane benchmarks share: fake generators, valid groups built cheaply, process meters.

Owns the pieces :mod:`benchmarks.broker` and :mod:`benchmarks.relay` run
side by side (the same fake generators on both, so the two runs differ
only in what stands where the broker stands), and the per-process CPU and
RSS meters :mod:`benchmarks.dataplane` and :mod:`benchmarks.scale` use too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import nats
import psutil
from nats.js.api import AckPolicy, ConsumerConfig

from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names
from asymptote.jetstream.publish import Outgoing, Publisher
from asymptote.jetstream.pull import durable_puller
from asymptote.lifecycle import die_with_parent

REPO = Path(__file__).resolve().parents[1]

GROUP_SIZE = 8
NUM_COMPLETION_TOKENS = 16
"""Tokens per completion: the embedded default's max_tokens."""
NUM_PROMPT_TOKENS = 8
FETCH_BATCH = 64
"""Messages per fetch of the raw baseline and of the fake generators."""
NUM_GENERATORS = 2


def synthetic_completions() -> bytes:
    """The serialized part of a group that does not depend on its task: G completions with
    log-probs and one version span, rewards 0 and 1 alternating, and the prompt tokens."""
    completions = [
        rollout_pb2.Completion(
            token_ids=[4 + (i + j) % 12 for j in range(NUM_COMPLETION_TOKENS)],
            logprobs=[-0.05 - 0.01 * j for j in range(NUM_COMPLETION_TOKENS)],
            version_spans=[rollout_pb2.VersionSpan(version=0, start=0, end=NUM_COMPLETION_TOKENS)],
            reward=float(i % 2),
            finish_reason="length",
        )
        for i in range(GROUP_SIZE)
    ]
    return rollout_pb2.RolloutGroup(
        prompt_token_ids=[1] + [4 + j for j in range(NUM_PROMPT_TOKENS - 1)],
        completions=completions,
        min_version=0,
        max_version=0,
    ).SerializeToString()


def synthetic_group(task: rollout_pb2.GenerationTask, generator_id: str, completions: bytes) -> bytes:
    """A valid serialized group for ``task``: its own fields, then ``completions``.

    Protobuf concatenation is a merge, so the two parts make one message; the
    fake generators build only the small part per task, since building
    completions is the generator's work and not what this benchmark measures.
    """
    now = time.time()
    return (
        rollout_pb2.RolloutGroup(
            group_id=task.task_id,
            task=task,
            generator_id=generator_id,
            started_unix_s=now,
            finished_unix_s=now,
        ).SerializeToString()
        + completions
    )


class ProcessMeter:
    """CPU seconds and peak RSS of one process, sampled (the process may be replaced, e.g. a restart)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.cpu_before = 0.0
        self.peak_rss_bytes = 0
        self._cpu_of_replaced = 0.0

    def replace(self, pid: int) -> None:
        with contextlib.suppress(psutil.Error):
            self._cpu_of_replaced += self._cpu_now()
        self.process = psutil.Process(pid)

    def _cpu_now(self) -> float:
        t = self.process.cpu_times()
        return float(t.user + t.system)

    def cpu_s(self) -> float:
        try:
            return self._cpu_of_replaced + self._cpu_now()
        except psutil.Error:  # gone (killed) since: what it used is counted at replace()
            return self._cpu_of_replaced

    def sample(self) -> None:
        with contextlib.suppress(psutil.Error):
            self.peak_rss_bytes = max(self.peak_rss_bytes, int(self.process.memory_info().rss))


class CpuMeter:
    """CPU seconds (user + system) of named processes between two moments."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.meters = {name: ProcessMeter(pid) for name, pid in pids.items()}
        self._start: dict[str, float] = {}
        self.used: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        return {name: m.cpu_s() for name, m in self.meters.items()}

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        now = self._now()
        self.used = {name: now[name] - self._start[name] for name in now}

    def per_group_us(self, groups: int) -> dict[str, float]:
        """Microseconds of CPU per group, by process."""
        return {name: 1e6 * s / groups for name, s in self.used.items()}


@dataclasses.dataclass
class GeneratorCounts:
    tasks_leased: int = 0
    fetches: int = 0
    """Fetches that brought tasks."""
    groups_published: int = 0
    duplicates: int = 0
    eval_tasks: int = 0
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set each time groups were published."""


async def fake_generator(nats_url: str, names: Names, index: int, stop: asyncio.Event, counts: GeneratorCounts) -> None:
    """Lease tasks like the rollout loop (shared durable, explicit acks) and answer each at once.

    A fetch's groups are published back to back and their acknowledgements
    awaited together, then its tasks are acked (a task is acked only once its
    group is stored, as the generator does).
    """
    nc = await nats.connect(nats_url, name=f"bench-generator-{index}")
    js = nc.jetstream()
    publisher = Publisher(js)
    generator_id = f"bench-generator-{index}"
    completions = synthetic_completions()
    try:
        puller = await durable_puller(
            js,
            names.tasks_stream,
            names.all_tasks,
            names.generators_consumer,
            ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0, max_deliver=5, max_ack_pending=-1),
        )
        while not stop.is_set():
            try:
                msgs = await puller.fetch(FETCH_BATCH, timeout_s=0.2)
            except TimeoutError:  # nats raises its subclass
                continue
            counts.tasks_leased += len(msgs)
            counts.fetches += 1
            groups = []
            for msg in msgs:
                task = rollout_pb2.GenerationTask.FromString(msg.data)
                if task.kind == rollout_pb2.TASK_KIND_TRAIN:
                    groups.append(
                        Outgoing(names.rollouts, synthetic_group(task, generator_id, completions), task.task_id)
                    )
                else:
                    counts.eval_tasks += 1  # the R0 eval round: nothing consumes its results here
            stored = await publisher.publish_all(groups)
            counts.groups_published += len(groups)
            counts.duplicates += sum(s.duplicate for s in stored)
            counts.changed.set()
            for msg in msgs:
                await msg.ack()
    finally:
        await nc.close()


def start_module(module: str, args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """``python -m module args`` from the repository root in a session of its own, its output appended to ``log_path``."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
