"""The sandbox pool's gRPC face: SandboxPool.Run and SandboxPool.Describe.

Run checks a request before anything runs: a program or stdin above its
cap, limits that ``Limits`` refuses, or limits above the pool's
``max_limits`` are INVALID_ARGUMENT with a message naming the field and
the cap; a request that finds ``max_concurrent_runs`` running and
``max_queued_runs`` waiting is RESOURCE_EXHAUSTED; once the pool drains
(its recycle after ``max_runs``, or a stop) a new request is UNAVAILABLE,
which a client retries on another replica. Either way the service keeps
serving. An accepted program runs in one of ``max_concurrent_runs``
threads (the sandbox's runner blocks on the program's pipes and pidfd); a
call the client gives up on leaves its program to finish within its own
deadline, still counted against the slots, so the cap holds.

Knows nothing about how a backend confines a program (asymptote.sandbox).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from pydantic import ValidationError

from asymptote.contracts.v1 import sandbox_pb2, sandbox_pb2_grpc
from asymptote.sandbox import Limits, RunResult, Sandbox
from asymptote.sandbox.remote import above_caps, limits_from_proto, limits_to_proto, result_to_proto
from services.sandbox_pool.config import SandboxPoolConfig
from services.sandbox_pool.metrics import SandboxPoolMetrics, outcome

log = logging.getLogger(__name__)


class SandboxPoolServicer(sandbox_pb2_grpc.SandboxPoolServicer):
    """Runs programs in ``sandbox``, at most ``max_concurrent_runs`` at once, until it drains."""

    def __init__(self, config: SandboxPoolConfig, sandbox: Sandbox, metrics: SandboxPoolMetrics) -> None:
        self.config = config
        self.sandbox = sandbox
        self.metrics = metrics
        self.num_runs = 0
        """Runs accepted since start."""
        self.outstanding = 0
        """Runs accepted and not finished: running, or waiting for a thread."""
        self.draining = False
        self.recycle = asyncio.Event()
        """Set when the run that reaches ``max_runs`` is accepted: the process should drain and exit 0."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._executor = ThreadPoolExecutor(max_workers=config.max_concurrent_runs, thread_name_prefix="sandbox-run")
        metrics.backend.labels(sandbox.name).set(1)
        for name in ("ok", "exit_nonzero", "signal", "timeout", "output_limit"):
            metrics.runs.labels(sandbox.name, name)
        metrics.runs_left.set(config.max_runs if config.max_runs is not None else -1)

    def _problem(self, request: sandbox_pb2.RunRequest) -> tuple[str, str, Limits | None]:
        """(refusal reason, message) for a request the pool cannot run, else ("", "", its limits)."""
        c = self.config
        program_bytes = len(request.program.encode("utf-8", "surrogatepass"))
        if program_bytes > c.max_program_bytes:
            return (
                "program_too_large",
                f"program is {program_bytes} bytes, above max_program_bytes {c.max_program_bytes}",
                None,
            )
        if len(request.stdin) > c.max_stdin_bytes:
            return (
                "stdin_too_large",
                f"stdin is {len(request.stdin)} bytes, above max_stdin_bytes {c.max_stdin_bytes}",
                None,
            )
        try:
            limits = limits_from_proto(request.limits, c.sandbox.limits)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return "bad_limits", f"limits.{where}: {first['msg']}, got {first['input']!r}", None
        above = above_caps(limits, c.max_limits)
        if above is not None:
            return "above_cap", above, None
        return "", "", limits

    def _refuse(self, reason: str) -> None:
        self.metrics.refusals.labels(reason).inc()

    async def Run(self, request: sandbox_pb2.RunRequest, context: grpc.aio.ServicerContext) -> sandbox_pb2.RunResponse:
        c = self.config
        reason, message, limits = self._problem(request)
        if limits is None:
            self._refuse(reason)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        assert limits is not None
        if self.draining:
            self._refuse("draining")
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "this sandbox pool is draining (recycle or stop): retry on another replica"
            )
        if self.outstanding >= c.max_concurrent_runs + c.max_queued_runs:
            self._refuse("queue_full")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"sandbox pool full: {c.max_concurrent_runs} runs running and {c.max_queued_runs} queued "
                "(max_concurrent_runs, max_queued_runs); retry later",
            )
        self.num_runs += 1
        if c.max_runs is not None:
            self.metrics.runs_left.set(c.max_runs - self.num_runs)
            if self.num_runs >= c.max_runs:
                log.info("sandbox pool: %d runs accepted (max_runs): draining to recycle", self.num_runs)
                self.draining = True
                self.recycle.set()
        result = await self._run(request.program, request.stdin, limits)
        return result_to_proto(result)

    async def _run(self, program: str, stdin: bytes, limits: Limits) -> RunResult:
        loop = asyncio.get_running_loop()
        accepted = time.monotonic()
        self.outstanding += 1
        self._idle.clear()
        self._gauges()

        def run() -> RunResult:
            loop.call_soon_threadsafe(self._started, accepted)
            return self.sandbox.run(program, stdin, limits)

        future = loop.run_in_executor(self._executor, run)
        future.add_done_callback(self._finished)
        # A cancelled call (the client's deadline) leaves the program to end within its own deadline.
        return await asyncio.shield(future)

    def _started(self, accepted: float) -> None:
        self.metrics.wait_seconds.observe(time.monotonic() - accepted)

    def _finished(self, future: asyncio.Future[RunResult]) -> None:
        self.outstanding -= 1
        self._gauges()
        if self.outstanding == 0:
            self._idle.set()
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:  # a bug in a backend, not the program's doing: loud, and the call fails
            log.error("sandbox run failed: %r", exc, exc_info=exc)
            return
        result = future.result()
        self.metrics.runs.labels(result.backend, outcome(result)).inc()
        self.metrics.run_seconds.observe(result.time_s)

    def _gauges(self) -> None:
        running = min(self.outstanding, self.config.max_concurrent_runs)
        self.metrics.running.set(running)
        self.metrics.queued.set(self.outstanding - running)

    async def Describe(
        self, request: sandbox_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.SandboxPoolInfo:
        c = self.config
        return sandbox_pb2.SandboxPoolInfo(
            backend=self.sandbox.name,
            default_limits=limits_to_proto(c.sandbox.limits),
            max_limits=limits_to_proto(c.max_limits),
            max_program_bytes=c.max_program_bytes,
            max_stdin_bytes=c.max_stdin_bytes,
            max_concurrent_runs=c.max_concurrent_runs,
            max_queued_runs=c.max_queued_runs,
            num_runs=self.num_runs,
            max_runs=c.max_runs or 0,
        )

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new runs and wait for the accepted ones to finish; False when some were still running."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("sandbox pool: %d runs still running after %.0fs of draining", self.outstanding, timeout_s)
            return False
        return True

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
