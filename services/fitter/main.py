"""``asymptote fitter``: parse config, set up logging, run the fitter."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.kv import KeyValue

from asymptote.best_round import best_round, publish_best_round
from asymptote.cli_args import service_parser
from asymptote.config import load_config, log_resolved
from asymptote.contracts.v1 import services_pb2_grpc
from asymptote.errors import PayloadError
from asymptote.jetstream.deadletter import deadletter
from asymptote.jetstream.names import ensure_bucket
from asymptote.lifecycle import run_until_stopped
from asymptote.logs import setup_logging
from asymptote.messages import decode_eval_result, decode_telemetry
from asymptote.policy import watch_policy
from asymptote.rpc import start_server
from asymptote.runtime import Runtime, service_runtime, supervise
from services.fitter.collector import RunCollectors
from services.fitter.compute_axis import ComputeAxis
from services.fitter.config import FitterConfig
from services.fitter.metrics import RunCollector, registry_with
from services.fitter.server import FitterServicer

log = logging.getLogger(__name__)


async def telemetry_loop(rt: Runtime, axis: ComputeAxis, stop: asyncio.Event) -> None:
    """Replay the whole telemetry stream, then follow it (an ordered consumer)."""

    async def on_msg(msg: Msg) -> None:
        try:
            telemetry = decode_telemetry(msg.data)
        except PayloadError as exc:
            # The stream is replayed on every start: the message id keeps one
            # copy. An ordered consumer's message takes no acknowledgement.
            seq = msg.metadata.sequence.stream if msg.metadata else 0
            await deadletter(rt.js, rt.names, msg, "telemetry", str(exc), msg_id=f"telemetry-{seq}", terminate=False)
            return
        axis.observe(telemetry)

    sub = await rt.js.subscribe(rt.names.telemetry, cb=on_msg, ordered_consumer=True)
    try:
        await stop.wait()
    finally:
        await sub.unsubscribe()


async def publish_best(rt: Runtime, kv: KeyValue, collector: RunCollectors) -> None:
    """Publish the run's best held-out round (the learner keeps its checkpoint); none before a round is scored."""
    best = best_round(point.row() for _, curve in collector.series() for point in curve.points)
    if best is not None:
        await publish_best_round(kv, rt.names, best)


async def evals_loop(rt: Runtime, collector: RunCollectors, stop: asyncio.Event) -> None:
    kv = await ensure_bucket(rt.js, rt.names.evals_bucket, replicas=rt.names.replicas)
    await publish_best(rt, kv, collector)  # a restarted fitter's rounds from eval.jsonl
    sub = await rt.js.pull_subscribe(
        rt.names.eval_results,
        durable=rt.names.fitter_evals_consumer,
        stream=rt.names.evals_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=60.0, max_deliver=5),
    )
    try:
        await _collect_evals(sub, rt, collector, stop, kv)
    finally:
        # nats-py's connection drain waits on a pull subscription's inbox for
        # good; unacked results are redelivered to the next fitter.
        await sub.unsubscribe()


async def _collect_evals(
    sub: JetStreamContext.PullSubscription, rt: Runtime, collector: RunCollectors, stop: asyncio.Event, kv: KeyValue
) -> None:
    held: dict[str, list[Msg]] = {}
    last_heartbeat = time.monotonic()
    while not stop.is_set():
        try:
            msgs = await sub.fetch(batch=256, timeout=1.0)
        except TimeoutError:  # nats raises its subclass, or asyncio's own
            continue
        for msg in msgs:
            try:
                result = decode_eval_result(msg.data)
            except PayloadError as exc:
                await deadletter(rt.js, rt.names, msg, "evals", str(exc))
                continue
            # Refits run in a thread: a bootstrap must not stall the event loop.
            if await asyncio.to_thread(collector.add_result, result) is not None:
                await publish_best(rt, kv, collector)
            # A round's results are acked once its point is in eval.jsonl: a
            # fitter that dies mid-round gets them redelivered (results are
            # keyed by task id, so a redelivered copy counts once).
            held.setdefault(result.eval_id, []).append(msg)
            if collector.is_done(result):
                for m in held.pop(result.eval_id):
                    await m.ack()
        if held and time.monotonic() - last_heartbeat > 15.0:  # well inside the 60 s ack wait
            last_heartbeat = time.monotonic()
            for m in (m for round_msgs in held.values() for m in round_msgs):
                await m.in_progress()


async def policy_loop(rt: Runtime, axis: ComputeAxis, stop: asyncio.Event) -> None:
    kv = await ensure_bucket(rt.js, rt.names.policy_bucket, replicas=rt.names.replicas)
    async for policy in watch_policy(kv, rt.names, stop):
        axis.mark_version(int(policy.version), policy.published_unix_s)


async def serve(config: FitterConfig, stop: asyncio.Event) -> None:
    axis = ComputeAxis(config.telemetry_stale_s)
    collector = RunCollectors(
        config.run_dir,
        config.run_name,
        config.curve,
        config.target_compute_multiples,
        axis,
        config.plot,
        config.planned_compute,
        config.compute_axis,
    )
    registry = registry_with(
        RunCollector(
            lambda: [(name, c.snapshot) for name, c in collector.series()], axis.by_service, axis.flops_by_service
        )
    )
    async with service_runtime("fitter", config.nats, config.prefix, config.http, registry) as rt:
        servicer = FitterServicer(collector)
        server, _ = await start_server(
            config.grpc,
            rt.health,
            lambda s: services_pb2_grpc.add_FitterServicer_to_server(servicer, s),
            ["asymptote.contracts.v1.Fitter"],
            config.grpc_tls,
        )
        await rt.health.unblock("starting")
        try:
            await supervise(
                stop,
                {
                    "telemetry": telemetry_loop(rt, axis, stop),
                    "policy": policy_loop(rt, axis, stop),
                    "evals": evals_loop(rt, collector, stop),
                },
            )
        finally:
            await rt.health.shutting_down()
            await server.stop(grace=2.0)


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("fitter", FitterConfig, "ASY_FITTER")
    parser.add_argument("--config", type=Path, help="YAML config file")
    args = parser.parse_args(argv)
    config = load_config(FitterConfig, args.config, "ASY_FITTER")
    setup_logging("fitter", config.log_format)
    log_resolved(config, "fitter")
    return run_until_stopped(lambda stop: serve(config, stop))
