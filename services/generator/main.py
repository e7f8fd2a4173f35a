"""``asymptote generator``: parse config, set up logging, run a generator."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

import grpc

from asymptote.cli_args import service_parser
from asymptote.compute import ComputeMeter, flop_params
from asymptote.config import load_config, log_resolved
from asymptote.contracts.v1 import services_pb2_grpc
from asymptote.envs import EnvironmentPool
from asymptote.errors import ConfigError
from asymptote.jetstream.names import ensure_bucket
from asymptote.lifecycle import run_until_stopped
from asymptote.logs import setup_logging
from asymptote.rpc import start_server
from asymptote.runtime import service_runtime, supervise
from asymptote.tasks import MultiTurnSettings
from services.generator.config import GeneratorConfig
from services.generator.engine import Engine, check_lora, check_platform
from services.generator.episode import EpisodeRunner
from services.generator.fanout import RELAY_SERVICE, WeightRelay, add_relay_to_server, weight_source
from services.generator.metrics import GeneratorMetrics
from services.generator.mixing import make_scorer
from services.generator.rollout import RolloutLoop
from services.generator.scoring import TaskScorer, check_sandboxes
from services.generator.server import GeneratorServicer
from services.generator.swapper import EvalHold, Swapper

log = logging.getLogger(__name__)


async def serve(config: GeneratorConfig, stop: asyncio.Event) -> None:
    metrics = GeneratorMetrics()
    async with service_runtime("generator", config.nats, config.prefix, config.http, metrics.registry) as rt:
        engine = Engine(config.engine, config.lora)
        await rt.health.block("engine", "vLLM engine starting")
        await engine.start()
        # A multi-turn task's environments run in worker processes beside the engine.
        multiturn = config.task if isinstance(config.task, MultiTurnSettings) else None
        envs = EnvironmentPool(multiturn.environment) if multiturn is not None else None
        try:
            if envs is not None:
                await envs.start()  # an environment that cannot load stops the generator here, once
            await rt.health.unblock("engine")
            weights_dir = config.weights_dir / rt.instance_id
            source = weight_source(config.fanout, config.grpc_tls, metrics)
            relay = WeightRelay(metrics)
            hold = EvalHold(config.eval_hold_versions)
            swapper = Swapper(
                engine,
                source,
                config.engine.model_dir,
                weights_dir,
                config.swap_mode,
                metrics,
                relay,
                hold,
                lora=config.lora,
            )
            policy_kv = await ensure_bucket(rt.js, rt.names.policy_bucket, replicas=rt.names.replicas)
            meter = ComputeMeter(
                "generator",
                rt.instance_id,
                config.device_kind,
                config.num_devices,
                num_params=flop_params(config.engine.model_dir),
            )
            scorer = make_scorer(config.task, config.engine.model_dir, metrics, config.sandbox_pool)
            episodes = None
            if multiturn is not None and envs is not None:
                assert isinstance(scorer, TaskScorer)  # a multi-turn task is its own scorer, never a mixture's
                try:
                    episodes = EpisodeRunner(
                        engine,
                        scorer.tokenizer(),
                        envs,
                        multiturn.chat_template_kwargs,
                        scorer.length_control(multiturn.name),
                    )
                except ValueError as exc:
                    raise ConfigError(f"task multiturn with the model in {config.engine.model_dir}: {exc}") from exc
            loop = RolloutLoop(
                engine,
                rt.js,
                rt.names,
                rt.instance_id,
                config.max_inflight_groups,
                config.task_ack_wait_s,
                metrics,
                meter,
                scorer,
                hold,
                episodes,
            )
            servicer = GeneratorServicer(engine, rt.health, rt.instance_id, metrics)

            def register(s: grpc.aio.Server) -> None:
                services_pb2_grpc.add_GeneratorServicer_to_server(servicer, s)
                add_relay_to_server(relay, s)

            server, _ = await start_server(
                config.grpc,
                rt.health,
                register,
                ["asymptote.contracts.v1.Generator", RELAY_SERVICE],
                config.grpc_tls,
            )
            await rt.health.unblock("starting")
            try:
                await supervise(
                    stop,
                    {
                        "rollout": loop.run(stop),
                        "watch": swapper.watch_loop(policy_kv, rt.names, stop),
                        "swap": swapper.swap_loop(stop),
                        "telemetry": meter.run(rt.js, rt.names, stop, config.telemetry_interval_s),
                    },
                    grace_s=30.0,
                )
            finally:
                await rt.health.shutting_down()
                await server.stop(grace=2.0)
                loop.scorer.close()
                shutil.rmtree(weights_dir, ignore_errors=True)
        finally:
            if envs is not None:
                envs.close()
            await engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("generator", GeneratorConfig, "ASY_GENERATOR")
    parser.add_argument("--config", type=Path, help="YAML config file")
    args = parser.parse_args(argv)
    config = load_config(GeneratorConfig, args.config, "ASY_GENERATOR")
    setup_logging("generator", config.log_format)
    log_resolved(config, "generator")
    check_platform(config.engine)
    check_lora(config.engine, config.lora)
    check_sandboxes(config.task, config.sandbox_pool)
    return run_until_stopped(lambda stop: serve(config, stop))
