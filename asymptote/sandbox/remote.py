"""The sandbox pool's wire: ``Limits`` and ``RunResult`` as protobuf, and the client side.

Owns the conversions both ends use (a ``SandboxLimits`` field left 0 takes
the pool's default; a ``RunResponse`` becomes the same ``RunResult`` the
local sandbox returns) and ``PoolSandbox``: the ``Sandbox`` that sends each
program to a pool (``asymptote sandbox-pool``) over gRPC, so a code
verifier's path is the same whether programs run here or there. Knows
nothing about how the pool confines them.

The client retries what another moment or another replica can serve:
UNAVAILABLE (a pool draining for its recycle, or restarting) and
RESOURCE_EXHAUSTED (its queue full), with backoff, and waits for a pool
that is not up yet, for ``queue_wait_s`` beyond the program's own
deadline in all. Past that, or on any other status, the call raises
``SandboxPoolError``: the scoring pool scores the completion as an error.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, get_args

import grpc

from asymptote.contracts.v1 import sandbox_pb2
from asymptote.sandbox.limits import BackendName, KillReason, Limits, PoolClientSettings, RunResult
from asymptote.sandbox.process import DRAIN_S

SERVICE_NAME = "asymptote.contracts.v1.SandboxPool"
LIMIT_FIELDS = ("timeout_s", "memory_mib", "num_processes", "file_size_mib", "open_files", "output_bytes")
"""The fields ``Limits`` and ``SandboxLimits`` share, by the same names."""
MAX_RESPONSE_BYTES = 64 << 20
"""A response holds at most two outputs of the pool's ``output_bytes`` cap; this bounds what a client takes."""
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""What another moment or another replica can serve: a draining or restarting pool, a full queue."""
BACKOFF_S = (0.05, 2.0)
"""First and longest pause between two tries (doubling)."""

# waitForReady: a call to a pool that is down waits for it (within its deadline) instead of failing at once.
# round_robin: a name that resolves to several pods (the chart's headless Service) spreads calls over them all.
_SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{"name": [{"service": SERVICE_NAME}], "waitForReady": True}],
}
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
    ("grpc.service_config", json.dumps(_SERVICE_CONFIG)),
    # A recycled pool is back in seconds: reconnect attempts stay that frequent (gRPC's own backoff grows to 2 min).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class SandboxPoolError(RuntimeError):
    """The pool did not run the program: unreachable, refused it, or too busy for longer than allowed."""


def limits_to_proto(limits: Limits) -> sandbox_pb2.SandboxLimits:
    return sandbox_pb2.SandboxLimits(**{name: getattr(limits, name) for name in LIMIT_FIELDS})


def limits_from_proto(message: sandbox_pb2.SandboxLimits, defaults: Limits) -> Limits:
    """``message``'s limits, each field left 0 taken from ``defaults``; pydantic's ValidationError for a
    value ``Limits`` refuses (a negative or NaN deadline, memory below 64 MiB, ...)."""
    given = {name: getattr(message, name) for name in LIMIT_FIELDS if getattr(message, name)}
    return Limits.model_validate({**defaults.model_dump(), **given})


def above_caps(limits: Limits, caps: Limits) -> str | None:
    """The first limit above its cap, named with both values; None when all are within."""
    for name in LIMIT_FIELDS:
        value, cap = getattr(limits, name), getattr(caps, name)
        if value > cap:
            return f"limits.{name} is {value:g}, above this pool's cap of {cap:g} (max_limits.{name})"
    return None


def result_to_proto(result: RunResult) -> sandbox_pb2.RunResponse:
    return sandbox_pb2.RunResponse(
        backend=result.backend,
        exit_code=result.exit_code,
        signal=result.signal,
        killed=result.killed or "",
        stdout=result.stdout,
        stderr=result.stderr,
        stdout_bytes=result.stdout_bytes,
        time_s=result.time_s,
    )


_BACKENDS: tuple[str, ...] = get_args(BackendName)
_KILLS: tuple[str, ...] = get_args(KillReason)


def result_from_proto(message: sandbox_pb2.RunResponse) -> RunResult:
    """The ``RunResult`` a pool's answer carries; SandboxPoolError for a backend or kill reason it cannot hold."""
    if message.backend not in _BACKENDS:
        raise SandboxPoolError(f"the pool answered backend {message.backend!r}; known: {', '.join(_BACKENDS)}")
    if message.killed and message.killed not in _KILLS:
        raise SandboxPoolError(f"the pool answered killed {message.killed!r}; known: {', '.join(_KILLS)}")
    killed: Any = message.killed or None
    backend: Any = message.backend
    return RunResult(
        backend=backend,
        exit_code=message.exit_code if message.HasField("exit_code") else None,
        signal=message.signal if message.HasField("signal") else None,
        killed=killed,
        stdout=message.stdout,
        stderr=message.stderr,
        stdout_bytes=message.stdout_bytes,
        time_s=message.time_s,
    )


def pool_channel(settings: PoolClientSettings) -> grpc.Channel:
    """A blocking channel to the pool (the verifier runs in scoring worker processes, without an event loop)."""
    tls = settings.tls
    if not tls.client_enabled:
        return grpc.insecure_channel(settings.endpoint, options=CHANNEL_OPTIONS)
    from asymptote.rpc import channel_credentials

    options = [*CHANNEL_OPTIONS]
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.secure_channel(settings.endpoint, channel_credentials(tls), options=options)


class PoolSandbox:
    """A ``Sandbox`` whose programs run in a sandbox pool; the results are the pool's backend's own."""

    def __init__(self, settings: PoolClientSettings) -> None:
        self.settings = settings
        self._channel: grpc.Channel | None = None
        self._lock = threading.Lock()
        self._backend: BackendName | None = None

    def _stub(self) -> tuple[grpc.UnaryUnaryMultiCallable[Any, Any], grpc.UnaryUnaryMultiCallable[Any, Any]]:
        with self._lock:
            if self._channel is None:
                self._channel = pool_channel(self.settings)
            run = self._channel.unary_unary(
                f"/{SERVICE_NAME}/Run",
                request_serializer=sandbox_pb2.RunRequest.SerializeToString,
                response_deserializer=sandbox_pb2.RunResponse.FromString,
            )
            describe = self._channel.unary_unary(
                f"/{SERVICE_NAME}/Describe",
                request_serializer=sandbox_pb2.DescribeRequest.SerializeToString,
                response_deserializer=sandbox_pb2.SandboxPoolInfo.FromString,
            )
        return run, describe

    @property
    def name(self) -> BackendName:
        """The pool's backend (asked once)."""
        if self._backend is None:
            info = self.describe()
            if info.backend not in _BACKENDS:
                raise SandboxPoolError(f"the pool at {self.settings.endpoint} runs an unknown backend {info.backend!r}")
            self._backend = info.backend  # type: ignore[assignment]  # checked just above
        assert self._backend is not None
        return self._backend

    def describe(self) -> sandbox_pb2.SandboxPoolInfo:
        """The pool's backend, its default limits and caps, and its runs so far."""
        _, describe = self._stub()
        try:
            info: sandbox_pb2.SandboxPoolInfo = describe(
                sandbox_pb2.DescribeRequest(), timeout=self.settings.queue_wait_s
            )
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        return info

    def run(self, program: str, stdin: bytes = b"", limits: Limits | None = None) -> RunResult:
        limits = limits or Limits()
        run, _ = self._stub()
        request = sandbox_pb2.RunRequest(program=program, stdin=stdin, limits=limits_to_proto(limits))
        wait_until = time.monotonic() + self.settings.queue_wait_s
        pause_s = BACKOFF_S[0]
        while True:
            # The program's deadline, the runner's drain after a kill, and what is left of the wait allowed.
            timeout_s = limits.timeout_s + DRAIN_S + max(0.0, wait_until - time.monotonic())
            try:
                response: sandbox_pb2.RunResponse = run(request, timeout=timeout_s)
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                if code not in RETRYABLE or time.monotonic() + pause_s >= wait_until:
                    raise self._error(exc) from None
                time.sleep(pause_s)  # backoff: the pool drains, restarts, or works through its queue
                pause_s = min(2 * pause_s, BACKOFF_S[1])
                continue
            return result_from_proto(response)

    def _error(self, exc: grpc.RpcError) -> SandboxPoolError:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        name = code.name if code is not None else "UNKNOWN"
        return SandboxPoolError(f"sandbox pool {self.settings.endpoint}: {name}: {details}")

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
