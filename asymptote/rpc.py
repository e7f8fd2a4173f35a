"""gRPC bootstrap shared by every server and client.

Servers are ``grpc.aio`` with the health service registered; message limits
stay at gRPC's defaults because tensors are chunked (see codec).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2_grpc

from asymptote.config import ListenSettings
from asymptote.health import Health

log = logging.getLogger(__name__)

# Keepalive so a dead peer is noticed in seconds, not at the next TCP timeout.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


async def start_server(
    listen: ListenSettings,
    health: Health,
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server with health checking; returns (server, port)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    register(server)
    health_pb2_grpc.add_HealthServicer_to_server(health.grpc, server)
    health.track_grpc(*service_names)
    port = server.add_insecure_port(f"{listen.host}:{listen.port}")
    if port == 0:
        raise OSError(f"cannot bind gRPC on {listen.host}:{listen.port}")
    await server.start()
    log.info("grpc on %s:%d (%s)", listen.host, port, ", ".join(service_names))
    return server, port


def channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
