"""The sandbox pool's Prometheus metrics (one registry per process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from asymptote.sandbox import RunResult

OUTCOMES = ("ok", "exit_nonzero", "signal", "timeout", "output_limit")
"""How a run ended (``outcome``): exported at 0 from the start."""
REFUSALS = ("program_too_large", "stdin_too_large", "bad_limits", "above_cap", "queue_full", "draining")
"""Why a request was refused without running: exported at 0 from the start."""
RUN_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def outcome(result: RunResult) -> str:
    """One of OUTCOMES for ``result``."""
    if result.killed is not None:
        return result.killed
    if result.exit_code is None:
        return "signal"
    return "ok" if result.exit_code == 0 else "exit_nonzero"


class SandboxPoolMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.runs = Counter(
            "asymptote_sandbox_pool_runs", "Programs run, by how they ended", ["backend", "outcome"], registry=r
        )
        self.refusals = Counter(
            "asymptote_sandbox_pool_refusals", "Requests refused without running, by reason", ["reason"], registry=r
        )
        self.run_seconds = Histogram(
            "asymptote_sandbox_pool_run_seconds",
            "Wall-clock time of one program, start to the last process gone",
            buckets=RUN_SECONDS_BUCKETS,
            registry=r,
        )
        self.wait_seconds = Histogram(
            "asymptote_sandbox_pool_wait_seconds",
            "Time a run waited for a free slot before it started",
            buckets=RUN_SECONDS_BUCKETS,
            registry=r,
        )
        self.running = Gauge("asymptote_sandbox_pool_running", "Programs running now", registry=r)
        self.queued = Gauge("asymptote_sandbox_pool_queued", "Runs accepted and waiting for a slot", registry=r)
        self.runs_left = Gauge(
            "asymptote_sandbox_pool_runs_left",
            "Runs this process accepts before it recycles (-1: no limit)",
            registry=r,
        )
        self.backend = Gauge(
            "asymptote_sandbox_pool_backend", "The sandbox backend in use (1)", ["backend"], registry=r
        )
        for reason in REFUSALS:
            self.refusals.labels(reason)
