"""``asymptote sandbox-pool``: parse config, set up logging, choose the sandbox, serve until stop or recycle.

Start: the sandbox's self-test (as ``asymptote sandbox selftest`` runs it)
before the pool reports ready; a machine where no backend passes (and
``unsafe_no_sandbox`` is off) exits 2 with the reason, since every run
would be refused. Stop (SIGTERM) and recycle (``max_runs`` reached) end
alike: not ready first, new runs refused, the accepted ones finished, exit
0. Kubernetes, or the local stack, starts a fresh process.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from asymptote.cli_args import service_parser
from asymptote.config import load_config, log_resolved
from asymptote.contracts.v1 import sandbox_pb2_grpc
from asymptote.errors import ConfigError
from asymptote.health import Health, start_http
from asymptote.lifecycle import run_until_stopped
from asymptote.logs import setup_logging
from asymptote.rpc import start_server
from asymptote.sandbox import SandboxUnavailable, select_sandbox
from asymptote.sandbox.remote import SERVICE_NAME
from services.sandbox_pool.config import SandboxPoolConfig
from services.sandbox_pool.metrics import SandboxPoolMetrics
from services.sandbox_pool.server import SandboxPoolServicer

log = logging.getLogger(__name__)


async def serve(config: SandboxPoolConfig, stop: asyncio.Event) -> None:
    metrics = SandboxPoolMetrics()
    health = Health("sandbox-pool")
    runner, _ = await start_http(health, metrics.registry, config.http)
    try:
        try:
            selection = await asyncio.to_thread(select_sandbox, config.sandbox)
        except SandboxUnavailable as exc:
            raise ConfigError(f"sandbox: {exc}") from exc
        servicer = SandboxPoolServicer(config, selection.sandbox, metrics)
        server, _ = await start_server(
            config.grpc,
            health,
            lambda s: sandbox_pb2_grpc.add_SandboxPoolServicer_to_server(servicer, s),
            [SERVICE_NAME],
            config.grpc_tls,
            max_receive_bytes=config.max_request_bytes,
        )
        await health.unblock("starting")
        try:
            recycle = asyncio.create_task(servicer.recycle.wait())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({recycle, stopped}, return_when=asyncio.FIRST_COMPLETED)
            recycle.cancel()
            stopped.cancel()
            why = "recycling" if servicer.recycle.is_set() else "stopping"
            await health.shutting_down()
            log.info("sandbox pool %s after %d runs: finishing %d", why, servicer.num_runs, servicer.outstanding)
            await servicer.drain(config.drain_s)
        finally:
            await server.stop(grace=2.0)
            servicer.close()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("sandbox-pool", SandboxPoolConfig, "ASY_SANDBOX_POOL")
    parser.add_argument("--config", type=Path, help="YAML config file")
    args = parser.parse_args(argv)
    config = load_config(SandboxPoolConfig, args.config, "ASY_SANDBOX_POOL")
    setup_logging("sandbox-pool", config.log_format)
    log_resolved(config, "sandbox-pool")
    return run_until_stopped(lambda stop: serve(config, stop))
