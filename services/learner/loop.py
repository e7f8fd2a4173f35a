"""The learner's training loop and its wiring (imports torch).

Owns the order of operations that makes the learner lose nothing: a batch's
messages are acked to the broker only after a durable checkpoint includes
the batch; on start the learner resumes from its newest checkpoint and asks
the broker to release every batch it had handed out and not seen acked. The
ids of the groups trained into the weights travel with them, so a copy the
broker redelivers after its own restart is acked as a duplicate, not trained
twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Sequence

import grpc
import torch
from transformers import PreTrainedModel

from asymptote.best_round import current_best_round
from asymptote.codec import read_signature
from asymptote.compute import ComputeMeter, flop_params
from asymptote.config import TlsSettings
from asymptote.contracts.v1 import rollout_pb2, services_pb2, services_pb2_grpc
from asymptote.errors import PayloadError
from asymptote.faults import failpoint
from asymptote.health import Health
from asymptote.jetstream.names import ensure_bucket
from asymptote.lifecycle import wait_or_stop
from asymptote.policy import current_policy, publish_policy
from asymptote.rpc import channel, start_server
from asymptote.runtime import Runtime, service_runtime, supervise
from services.learner import checkpoint
from services.learner.checkpoint import Checkpointer
from services.learner.config import LearnerConfig
from services.learner.distributed import DataParallel, DrainWatch, NodeHealth, failing_fast, mark_draining
from services.learner.export import keep_model_files
from services.learner.host_buffers import HostBuffers
from services.learner.metrics import LearnerMetrics
from services.learner.minibatch import collate_mini_batches
from services.learner.model import Precision, empty_model, load_tokenizer
from services.learner.server import LearnerServicer, add_learner_to_server
from services.learner.trainer import StepInputs, Trainer, collate
from services.learner.weights import Staged, Version, WeightStore

log = logging.getLogger(__name__)

MAX_TRAINED_IDS = 200_000
"""Group ids remembered as trained (checkpointed with the weights); far more than can be redelivered."""


def rollout_rates(header: services_pb2.BatchHeader) -> dict[str, float]:
    """The broker's counts of the completions received since the previous batch, before any filter,
    and their interruption and truncation rates (0 when none arrived)."""
    n = header.num_completions
    return {
        "rollout/completions": float(n),
        "rollout/interrupted": float(header.num_interrupted),
        "rollout/truncated": float(header.num_truncated),
        "rollout/interruption_rate": header.num_interrupted / n if n else 0.0,
        "rollout/truncation_rate": header.num_truncated / n if n else 0.0,
    }


SHUTDOWN_ACK_ATTEMPTS = 3
"""Tries of the last ack when the learner stops (about 1.5 s): the broker may be stopping too."""


class BrokerClient:
    """The learner's calls to Broker; marks the learner not ready while unreachable."""

    def __init__(self, endpoint: str, health: Health, tls: TlsSettings | None = None) -> None:
        self.endpoint = endpoint
        self.health = health
        self._channel = channel(endpoint, tls)
        self.stub = services_pb2_grpc.BrokerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def next_batch(
        self, version: int, num_groups: int, timeout_s: float
    ) -> tuple[services_pb2.BatchHeader, list[rollout_pb2.RolloutGroup]] | None:
        header = None
        groups: list[rollout_pb2.RolloutGroup] = []
        try:
            call = self.stub.NextBatch(
                services_pb2.NextBatchRequest(
                    learner_version=version, num_groups=num_groups, timeout_s=timeout_s, packed=True
                ),
                timeout=timeout_s + 30.0,
            )
            async for part in call:
                if part is None:  # grpc.aio's answer to response bytes that do not parse
                    call.cancel()
                    raise PayloadError("the broker sent NextBatch bytes that are not a BatchPart")
                kind = part.WhichOneof("part")
                if kind == "header":
                    header = part.header
                elif kind == "groups":
                    groups.extend(part.groups.groups)
                else:  # a broker that sends one group a part
                    groups.append(part.group)
        except grpc.aio.AioRpcError as exc:
            await self.health.block("broker", f"broker at {self.endpoint} unreachable: {exc.code().name}")
            return None
        await self.health.unblock("broker")
        if header is None or not header.batch_id:
            return None
        if len(groups) != header.num_groups:
            raise PayloadError(f"batch {header.batch_id}: header says {header.num_groups} groups, got {len(groups)}")
        return header, groups

    async def ack(
        self, batches: Sequence[services_pb2.AckedBatch], release_unacked: bool = False, attempts: int = 30
    ) -> None:
        """Ack with bounded retries; the batches stay safe in JetStream meanwhile."""
        delay = 0.5
        for attempt in range(attempts):
            try:
                resp = await self.stub.Ack(
                    services_pb2.AckRequest(batches=batches, release_unacked=release_unacked),
                    timeout=10.0,
                )
                if resp.unknown_batch_ids:
                    log.warning(
                        "broker did not know batches %s (it restarted: JetStream redelivers them)",
                        list(resp.unknown_batch_ids)[:3],
                    )
                await self.health.unblock("broker")
                return
            except grpc.aio.AioRpcError as exc:
                await self.health.block("broker", f"broker at {self.endpoint} unreachable: {exc.code().name}")
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


def build_trainer(config: LearnerConfig, dp: DataParallel) -> tuple[PreTrainedModel, Trainer]:
    """The policy on this rank's device (its own shards of it under FSDP2), allocated, its weights not
    read yet (``Trainer.start``), and its trainer with the checkpoints' writer."""
    precision = Precision.resolve(config.device, config.dtype, head=config.head_precision)
    model = empty_model(config.model_dir, precision, config.trust_remote_code)
    log.info(
        "rank %d: %s on %s, computing in %s with an FP32 head",
        dp.rank,
        type(model).__name__,
        precision.device,
        str(precision.compute_dtype).removeprefix("torch."),
    )
    trainer = Trainer(
        model,
        config.loss,
        config.optimizer,
        dp,
        precision,
        parallelism=config.parallelism,
        micro_batch_tokens=config.micro_batch_tokens,
        activation_checkpointing=config.activation_checkpointing,
        packing=config.packing,
        lora=config.lora,
        moe=config.moe,
    )
    trainer.checkpointer = Checkpointer(
        config.run_dir / "checkpoints",
        config.keep_checkpoints,
        distributed=dp.distributed,
        rank=dp.rank,
        pin_staging=precision.device.type == "cuda",
        keep_best=config.keep_best_checkpoint,
    )
    if dp.distributed:
        log.info("rank %d: %s over %d ranks", dp.rank, "FSDP2" if trainer.sharded else "DDP", dp.world_size)
    return model, trainer


class Learner:
    def __init__(
        self, config: LearnerConfig, rt: Runtime, metrics: LearnerMetrics, dp: DataParallel | None = None
    ) -> None:
        self.config = config
        self.dp = dp or DataParallel()
        self.rt = rt
        self.metrics = metrics
        self.model, self.trainer = build_trainer(config, self.dp)
        tokenizer = load_tokenizer(config.model_dir, config.trust_remote_code)
        # Padding is masked everywhere; a model without a pad token pads with EOS.
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad or 0)
        self.store = WeightStore(
            self.trainer.served_signature() or read_signature(config.model_dir),
            keep=config.served_versions_kept,
            host_buffers=HostBuffers.for_device(self.trainer.precision.device),
        )
        self.ckpt_root = config.run_dir / "checkpoints"
        self.version = 0
        """Policy version: strictly increasing across restarts (generators and the broker rely on it)."""
        self.step = 0
        """Optimizer steps in the weights (restored from a checkpoint, so it can repeat after a crash)."""
        self.samples_trained = 0
        self.publishing: asyncio.Task[None] | None = None
        """The last staged version being digested and announced, beside the next step (``serve``)."""
        self.unacked: list[services_pb2.AckedBatch] = []
        # Groups trained into the current weights, newest last: a redelivered
        # copy (the broker restarted before it saw the ack) is not trained again.
        self.trained_ids: OrderedDict[str, None] = OrderedDict()
        self.meter = ComputeMeter(
            "learner", rt.instance_id, config.device_kind, config.num_devices, num_params=flop_params(config.model_dir)
        )
        self.metrics_path = config.run_dir / "metrics.jsonl"
        self.done = asyncio.Event()
        self.acking: list[services_pb2.AckedBatch] = []
        """The batches the checkpoint being written holds: acked once it is committed."""

    async def start(self) -> None:
        """Every rank reads its weights: the newest checkpoint's (with its counters), else the model directory's."""
        found = checkpoint.latest(self.ckpt_root)
        started = time.perf_counter()
        restored = await asyncio.to_thread(self.trainer.start, self.config.model_dir, found)
        if restored is None:
            log.info(
                "no checkpoint in %s: started from %s at version 0 (%.1fs)",
                self.ckpt_root,
                self.config.model_dir,
                time.perf_counter() - started,
            )
            return
        self.version = restored.version
        self.step = restored.step
        self.samples_trained = restored.samples_trained
        self.trained_ids = OrderedDict.fromkeys(restored.trained_group_ids)
        log.info("resumed from %s at version %d (%.1fs)", restored.path, self.version, time.perf_counter() - started)

    def gauges(self) -> dict[str, float]:
        return {
            "policy_version": float(self.version),
            "samples_trained": float(self.samples_trained),
            "unacked_batches": float(len(self.unacked)),
            "done": 1.0 if self.done.is_set() else 0.0,
        }

    def snapshot(self) -> Version:
        """The current weights as the served version ``self.version`` (FSDP2 ranks join the gathers)."""
        return self.store.publish(self.stage())

    def stage(self) -> Staged:
        """The current weights copied out in the served dtypes as version ``self.version`` (FSDP2 ranks
        join the gathers): what must happen before the next step moves them."""
        return self.store.stage(self.version, self.trainer.served_tensors(self.store.names))

    async def serve(self) -> None:
        """Serve the current weights as version ``self.version``.

        Only the copy out (``stage``) holds the step loop; the digest and the
        announcement run beside the next step. The previous version's are
        awaited first, so versions are announced in order and at most one is
        in flight.
        """
        started = time.perf_counter()
        await self.served()
        staged = await asyncio.to_thread(self.stage)
        self.metrics.serve_stall_s.inc(time.perf_counter() - started)
        self.publishing = asyncio.create_task(self._publish(staged, self.samples_trained, self.step))

    async def served(self) -> None:
        """Wait until the last staged version is announced (raises what its digest or announcement raised)."""
        publishing, self.publishing = self.publishing, None
        if publishing is not None:
            await publishing

    async def _publish(self, staged: Staged, samples_trained: int, step: int) -> None:
        started = time.perf_counter()
        v = await asyncio.to_thread(self.store.publish, staged)
        self.metrics.publish_s.inc(time.perf_counter() - started)
        await self.announce(v, samples_trained, step)

    async def announce(self, v: Version, samples_trained: int | None = None, step: int | None = None) -> None:
        """Publish ``v`` as the policy; ``samples_trained`` and ``step``: as of its weights (default: now)."""
        samples_trained = self.samples_trained if samples_trained is None else samples_trained
        step = self.step if step is None else step
        policy = rollout_pb2.PolicyVersion(
            version=v.version,
            weights_endpoint=f"{self.config.advertise_host}:{self.grpc_port}",
            digest=v.digest,
            num_bytes=v.num_bytes,
            num_tensors=len(v.tensors),
            published_unix_s=time.time(),
            samples_trained=samples_trained,
            step=step,
            final=step >= self.config.max_steps,
        )
        await publish_policy(self.kv, self.rt.names, policy)
        self.metrics.policy_version.set(v.version)
        # The steps in these weights are in the meter already (``_train_step`` counts a step before the next
        # one can announce): the fitter reads the compute of this version off this report.
        await self.meter.publish_version(self.rt.js, self.rt.names, v.version, policy.published_unix_s)

    def _meta(self) -> checkpoint.Meta:
        return self.trainer.meta(self.version, self.step, self.samples_trained, list(self.trained_ids))

    async def begin_checkpoint(self, broker: BrokerClient) -> None:
        """Start a checkpoint of the current weights (training goes on while it is written); the batches
        trained into them are acked once it is committed (``commit_checkpoint``)."""
        await self.commit_checkpoint(broker)  # one in flight at a time: the previous one first
        started = time.perf_counter()
        await asyncio.to_thread(self.trainer.save, self.version, self._meta())
        self.acking, self.unacked = self.unacked, []
        self.metrics.checkpoint_stall_s.inc(time.perf_counter() - started)
        log.info("checkpoint of version %d staged in %.2fs", self.version, time.perf_counter() - started)

    async def commit_checkpoint(self, broker: BrokerClient, wait: bool = True, ack_attempts: int = 30) -> None:
        """Commit the checkpoint in flight and ack the batches it holds; ``wait`` False: only if it is written."""
        writer = self.trainer.checkpointer
        assert writer is not None, "build_trainer sets the checkpointer"
        if writer.in_flight is None or not (wait or writer.ready()):
            return
        await self.read_best_round()
        started = time.perf_counter()
        path = await asyncio.to_thread(writer.finish)
        log.info("checkpoint %s committed (waited %.2fs)", path, time.perf_counter() - started)
        if self.acking:
            await broker.ack(self.acking, attempts=ack_attempts)
            self.acking = []

    async def read_best_round(self) -> None:
        """Tell the checkpointer the best held-out round the fitter published, before it prunes. When NATS does
        not answer it keeps what it knew (at start: nothing, so it prunes nothing)."""
        writer = self.trainer.checkpointer
        assert writer is not None, "build_trainer sets the checkpointer"
        if not self.config.keep_best_checkpoint:
            return
        try:
            best = await current_best_round(self.evals_kv, self.rt.names)
        except Exception as exc:  # NATS unreachable, a bad entry: pruning waits, training goes on
            log.warning("cannot read the best held-out round (%s); pruning keeps what it knew", exc)
            return
        writer.set_best(best)

    async def train_loop(self, broker: BrokerClient, stop: asyncio.Event) -> None:
        c = self.config
        await broker.ack([], release_unacked=True)
        waited = 0.0
        last_wait_log = time.monotonic()
        while self.step < c.max_steps and not stop.is_set():
            t0 = time.perf_counter()
            try:
                got = await broker.next_batch(self.version, c.batch_prompts, c.batch_wait_s)
            except PayloadError as exc:
                # Nothing of it is trained or acked: the broker's lease on its
                # groups runs out and JetStream delivers them again.
                self.metrics.bad_batches.inc()
                log.error("refused a batch from the broker: %s", exc)
                await wait_or_stop(stop, 1.0)
                continue
            finally:
                waited += time.perf_counter() - t0
            if got is None:
                # The other ranks wait in a collective meanwhile: a message keeps it within its timeout.
                await asyncio.to_thread(self.trainer.heartbeat)
                await self.commit_checkpoint(broker, wait=False)
                if time.monotonic() - last_wait_log > 30.0:
                    log.info("waiting for data at version %d (%.0fs so far)", self.version, waited)
                    last_wait_log = time.monotonic()
                if not self.rt.health.ready:
                    await wait_or_stop(stop, 1.0)
                continue
            header, groups = got
            dups = [g.group_id for g in groups if g.group_id in self.trained_ids]
            fresh = [g for g in groups if g.group_id not in self.trained_ids]
            try:
                minis = self.collate(fresh, header) if fresh else []
            except PayloadError as exc:
                # A group the model cannot train on (its routing does not fit): the batch is neither
                # trained nor acked, as a batch that does not decode; the broker serves its groups again.
                self.metrics.bad_batches.inc()
                log.error("refused batch %s: %s", header.batch_id, exc)
                await wait_or_stop(stop, 1.0)
                continue
            self.unacked.append(
                services_pb2.AckedBatch(
                    batch_id=header.batch_id, group_ids=[g.group_id for g in groups], duplicate_group_ids=dups
                )
            )
            if dups:
                log.warning(
                    "batch %s: %d groups already trained (redelivered); kept out of the loss",
                    header.batch_id,
                    len(dups),
                )
                if not fresh:
                    continue
            for g in fresh:
                self.trained_ids[g.group_id] = None
            while len(self.trained_ids) > MAX_TRAINED_IDS:
                self.trained_ids.popitem(last=False)
            for i, inputs in enumerate(minis):
                await self._train_step(inputs, header, waited, first=i == 0, announce=i == len(minis) - 1)
                waited = 0.0
            await self.commit_checkpoint(broker, wait=False)
            if self.step % c.checkpoint_every_steps == 0 or self.step >= c.max_steps:
                await self.begin_checkpoint(broker)
        if self.step >= c.max_steps:
            await self.served()
            await self.commit_checkpoint(broker)
            log.info("reached max_steps=%d; serving the final weights until stopped", c.max_steps)
            await asyncio.to_thread(self.trainer.release_followers)
            self.done.set()
            await stop.wait()

    def collate(self, groups: list[rollout_pb2.RolloutGroup], header: services_pb2.BatchHeader) -> list[StepInputs]:
        """The batch's steps (``updates_per_batch`` mini-batches), each checked against the model
        (``Trainer.check_routing``); PayloadError naming the group that does not fit, before anything trains."""
        k = self.config.updates_per_batch
        layout = self.trainer.routing_layout
        minis = (
            [collate(groups, self.pad_id, header, layout)]
            if k == 1
            else collate_mini_batches(groups, self.pad_id, header, k, layout)
        )
        return [self.trainer.check_routing(inputs) for inputs in minis]

    async def _train_step(
        self, inputs: StepInputs, header: services_pb2.BatchHeader, waited: float, first: bool, announce: bool
    ) -> None:
        """One optimizer step; ``announce``: publish the new weights (PPO-off-policy-k: after the last mini-batch).

        ``first``: the batch's first step, which records the header's counts (drops, rollouts), once per batch.
        """
        step = await asyncio.to_thread(self.trainer.step, inputs, self.version)
        # Mid-step: the weights moved in memory, nothing announced or checkpointed yet.
        failpoint("learner.step.trained", self.step + 1)
        self.version += 1
        self.step += 1
        self.samples_trained += int(inputs.rewards.numel())
        if announce:
            await self.serve()
        self.meter.add_busy(step["time/compute_s"], int(step["batch/tokens"]))
        # The FLOPs of the step's real tokens, prompts with completions (padding is the packing's loss, not
        # work the recipe asks for); a step whose loss held nothing ran its forward only.
        self.meter.add_trained(int(inputs.batch.attention_mask.sum()), backward=step["batch/kept_prompts"] > 0)
        record = {
            "step": self.step,
            "policy_version": self.version,
            "unix_s": time.time(),
            "samples_trained": self.samples_trained,
            "time/wait_s": waited,
            "batch/zero_variance_dropped": float(header.num_zero_variance) if first else 0.0,
            "batch/stale_dropped": float(header.num_stale_dropped) if first else 0.0,
            **rollout_rates(header if first else services_pb2.BatchHeader()),
            **step,
        }
        self.metrics.steps.inc()
        self.metrics.samples.inc(int(inputs.rewards.numel()))
        self.metrics.wait_s.inc(waited)
        self.metrics.compute_s.inc(step["time/compute_s"])
        self.metrics.record_step(record)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    async def run(self, stop: asyncio.Event) -> None:
        c = self.config
        c.run_dir.mkdir(parents=True, exist_ok=True)
        keep_model_files(c.model_dir, c.run_dir)  # what `asymptote export` writes beside the weights
        await self.start()
        self.kv = await ensure_bucket(self.rt.js, self.rt.names.policy_bucket, replicas=self.rt.names.replicas)
        self.evals_kv = await ensure_bucket(self.rt.js, self.rt.names.evals_bucket, replicas=self.rt.names.replicas)
        announced = await current_policy(self.kv, self.rt.names)
        if announced is not None and announced.version > self.version:
            # Versions after the checkpoint were announced and are lost with the
            # crash: the restored weights get the next version, never an old one.
            log.info(
                "policy version %d was announced; restored step %d weights become version %d",
                announced.version,
                self.step,
                announced.version + 1,
            )
            self.version = int(announced.version) + 1
        v = await asyncio.to_thread(self.snapshot)
        servicer = LearnerServicer(self.store, self.rt.health, self.rt.instance_id, self.gauges)
        server, self.grpc_port = await start_server(
            c.grpc,
            self.rt.health,
            lambda s: add_learner_to_server(servicer, s),
            ["asymptote.contracts.v1.Learner"],
            c.grpc_tls,
        )
        await self.announce(v)
        broker = BrokerClient(c.broker_endpoint, self.rt.health, c.grpc_tls)
        await self.rt.health.unblock("starting")
        draining = asyncio.create_task(self._mark_draining(stop))
        try:
            await supervise(
                stop,
                {
                    "train": self.train_loop(broker, stop),
                    "telemetry": self.meter.run(self.rt.js, self.rt.names, stop, c.telemetry_interval_s),
                },
                grace_s=60.0,
            )
        except Exception:
            # Fail fast: no collective after a failure (the other ranks may be inside another one). The
            # batches not acked are delivered again to the learner torchrun restarts.
            self.rt.health.live = False
            raise
        finally:
            draining.cancel()
            if self.publishing is not None:
                self.publishing.cancel()
            await self.rt.health.shutting_down()
        try:
            if self.unacked:
                await self.begin_checkpoint(broker)
            try:
                await self.commit_checkpoint(broker, ack_attempts=SHUTDOWN_ACK_ATTEMPTS)
            except grpc.aio.AioRpcError as exc:
                # Stopped with the broker (a Ctrl-C of the local stack, a release scaled down): the checkpoint
                # is committed; its batches, not acked, are delivered again and its trained ids keep them out.
                log.warning(
                    "stopping without acking %d trained batches (broker unreachable: %s); the checkpoint "
                    "holds their groups' ids, so their redelivery is not trained again",
                    len(self.acking),
                    exc.code().name,
                )
        finally:
            await broker.close()
            await server.stop(grace=2.0)
        await asyncio.to_thread(self.trainer.release_followers)
        self.trainer.close()

    async def _mark_draining(self, stop: asyncio.Event) -> None:
        """When a stop is asked: tell the other ranks (through torchrun's store) that rank 0 drains."""
        await stop.wait()
        await asyncio.to_thread(mark_draining, self.dp)


async def serve(config: LearnerConfig, stop: asyncio.Event, dp: DataParallel | None = None) -> None:
    torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    metrics = LearnerMetrics()
    dp = dp or DataParallel()
    with failing_fast(dp, "rank 0"):
        async with service_runtime("learner", config.nats, config.prefix, config.http, metrics.registry) as rt:
            await Learner(config, rt, metrics, dp).run(stop)
    dp.close()


def follow(config: LearnerConfig, dp: DataParallel) -> int:
    """Ranks > 0 of a torchrun launch: take rank 0's steps until it releases them.

    SIGTERM and SIGINT are rank 0's to act on: it drains, checkpoints and
    then releases the other ranks, which follow meanwhile. A follower that
    gets one while rank 0 is not draining (rank 0 died: torchrun stops the
    group) exits. Any exception ends the process at once, non-zero, so
    torchrun stops every rank and the restarted group resumes from the last
    checkpoint; no rank is left waiting in a collective its peers never
    enter. The first rank of each node beyond rank 0's serves ``/healthz``
    and ``/readyz`` on the learner's HTTP port for that node's probes.
    """
    watchdog = DrainWatch(dp)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, watchdog.on_signal)
    health = (
        NodeHealth.start(config.http.host, config.http.port) if int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    )
    with failing_fast(dp, f"rank {dp.rank}"):
        torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        _, trainer = build_trainer(config, dp)
        trainer.start(config.model_dir)
        if health is not None:
            health.ready = True
        log.info("rank %d of %d following rank 0", dp.rank, dp.world_size)
        steps = trainer.follow()
        log.info("rank %d released by rank 0 after %d steps", dp.rank, steps)
        trainer.close()
    if health is not None:
        health.stop()
    dp.close()
    return 0
