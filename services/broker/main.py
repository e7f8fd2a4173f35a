"""``asymptote broker``: parse config, set up logging, run the broker."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from asymptote.cli_args import service_parser
from asymptote.config import load_config, log_resolved
from asymptote.jetstream.names import ensure_bucket
from asymptote.jetstream.preflight import check_max_payload
from asymptote.lifecycle import run_until_stopped
from asymptote.logs import setup_logging
from asymptote.rpc import start_server
from asymptote.runtime import service_runtime, supervise
from services.broker.config import BrokerConfig
from services.broker.metrics import BrokerMetrics
from services.broker.pipeline import BrokerPipeline
from services.broker.server import BrokerServicer, add_broker_to_server

log = logging.getLogger(__name__)


async def serve(config: BrokerConfig, stop: asyncio.Event) -> None:
    metrics = BrokerMetrics()
    async with service_runtime("broker", config.nats, config.prefix, config.http, metrics.registry) as rt:
        policy_kv = await ensure_bucket(rt.js, rt.names.policy_bucket, replicas=rt.names.replicas)
        curriculum_kv = await ensure_bucket(rt.js, rt.names.curriculum_bucket, replicas=rt.names.replicas)
        pipeline = BrokerPipeline(config, rt.js, rt.names, curriculum_kv, policy_kv, metrics)
        # Before any task is issued: a group NATS would refuse is lost work, found late.
        check_max_payload(rt.nc.max_payload, pipeline.largest_message(), config.nats.url)
        await pipeline.load_state()
        servicer = BrokerServicer(pipeline, rt.health, rt.instance_id)
        server, _ = await start_server(
            config.grpc,
            rt.health,
            lambda s: add_broker_to_server(servicer, s),
            ["asymptote.contracts.v1.Broker"],
            config.grpc_tls,
        )
        await rt.health.unblock("starting")
        try:
            await supervise(
                stop,
                {
                    "issue": pipeline.issue_loop(stop),
                    "consume": pipeline.consume_loop(stop),
                    "policy": pipeline.policy_loop(stop),
                    "persist": pipeline.persist_loop(stop),
                    "upkeep": pipeline.upkeep_loop(stop),
                },
            )
        finally:
            await rt.health.shutting_down()
            await server.stop(grace=5.0)
            try:
                await pipeline.save_state()
            except Exception as exc:
                log.warning("final curriculum save failed: %s", exc)


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("broker", BrokerConfig, "ASY_BROKER")
    parser.add_argument("--config", type=Path, help="YAML config file")
    args = parser.parse_args(argv)
    config = load_config(BrokerConfig, args.config, "ASY_BROKER")
    setup_logging("broker", config.log_format)
    log_resolved(config, "broker")
    return run_until_stopped(lambda stop: serve(config, stop))
