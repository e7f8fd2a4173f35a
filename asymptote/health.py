"""Liveness, readiness and the metrics endpoint, over HTTP and gRPC.

One :class:`Health` object per service says whether it is ready and why
not; the HTTP server (``/healthz``, ``/readyz``, ``/metrics``) and the gRPC
health servicer both read it, so Kubernetes probes and ``grpc_health_probe``
agree.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from asymptote.config import ListenSettings

log = logging.getLogger(__name__)


class Health:
    """Readiness of one service, named conditions that must all hold."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.live = True
        self._blockers: dict[str, str] = {"starting": "service is starting"}
        self.grpc = health_aio.HealthServicer()
        self._grpc_names: list[str] = [""]

    def track_grpc(self, *service_names: str) -> None:
        self._grpc_names.extend(service_names)

    @property
    def ready(self) -> bool:
        return self.live and not self._blockers

    @property
    def detail(self) -> str:
        return "; ".join(f"{k}: {v}" for k, v in sorted(self._blockers.items()))

    async def block(self, condition: str, why: str) -> None:
        """Mark not ready because ``condition`` fails (logged once per change)."""
        if self._blockers.get(condition) != why:
            log.warning("%s not ready: %s: %s", self.service, condition, why)
        self._blockers[condition] = why
        await self._publish()

    async def unblock(self, condition: str) -> None:
        if self._blockers.pop(condition, None) is not None:
            log.info("%s: %s ok%s", self.service, condition, "; ready" if self.ready else "")
        await self._publish()

    async def shutting_down(self) -> None:
        """Flip to not-serving first, so load balancers stop sending work."""
        self._blockers["shutdown"] = "shutting down"
        await self._publish()

    async def _publish(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self.ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._grpc_names:
            await self.grpc.set(name, status)


async def start_http(health: Health, registry: CollectorRegistry, listen: ListenSettings) -> tuple[web.AppRunner, int]:
    """Serve /healthz, /readyz and /metrics; returns the runner and bound port."""

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(status=200 if health.live else 503, text="ok" if health.live else "dead")

    async def readyz(_: web.Request) -> web.Response:
        body = json.dumps({"service": health.service, "ready": health.ready, "detail": health.detail})
        return web.Response(status=200 if health.ready else 503, text=body, content_type="application/json")

    async def metrics(_: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, listen.host, listen.port)
    await site.start()
    # The bound address: the port the OS picked when ``listen.port`` is 0.
    port = runner.addresses[0][1] if runner.addresses else listen.port
    log.info("http on %s:%d (/healthz /readyz /metrics)", listen.host, port)
    return runner, int(port)
