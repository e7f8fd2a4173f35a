"""The sandbox pool's configuration (one frozen model, loaded by asymptote.config).

Not a ``ServiceSettings``: the pool talks to no NATS and owns no streams, so
it has the listeners, TLS and log format every service has, and nothing of
a run's prefix.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from asymptote.config import Frozen, ListenSettings, TlsSettings
from asymptote.logs import LogFormat
from asymptote.sandbox import Limits, SandboxSettings
from asymptote.sandbox.remote import LIMIT_FIELDS, above_caps

MESSAGE_OVERHEAD_BYTES = 64 << 10
"""Room in a request beside the program and stdin (limits, framing)."""


class SandboxPoolConfig(Frozen):
    """Sandbox pool: runs model-written programs for the code verifier, over gRPC."""

    grpc: ListenSettings = ListenSettings(port=50091)
    """gRPC listener (SandboxPool service and health)."""
    grpc_tls: TlsSettings = TlsSettings()
    """TLS (or mTLS) for the gRPC server; off by default."""
    http: ListenSettings = ListenSettings(port=9105)
    """HTTP listener (/metrics, /healthz, /readyz)."""
    log_format: LogFormat = "auto"
    """Log format: JSON in pods, text on a terminal."""
    sandbox: SandboxSettings = SandboxSettings()
    """The sandbox the programs run in (chosen by its self-test at start); its limits fill what a request
    leaves 0."""
    max_limits: Limits = Limits(
        timeout_s=120.0, memory_mib=8192, num_processes=64, file_size_mib=64, open_files=256, output_bytes=4 << 20
    )
    """The most a request may ask for, field by field; a request above any is refused (INVALID_ARGUMENT)."""
    max_program_bytes: int = Field(default=1 << 20, ge=1024)
    """Largest program accepted (UTF-8 bytes)."""
    max_stdin_bytes: int = Field(default=8 << 20, ge=0)
    """Largest standard input accepted."""
    max_concurrent_runs: int = Field(default=4, ge=1)
    """Programs run at once (one thread each); match the CPUs the pool may use."""
    max_queued_runs: int = Field(default=64, ge=0)
    """Runs accepted beyond those running, waiting for a slot; one more is refused (RESOURCE_EXHAUSTED)."""
    max_runs: int | None = Field(default=None, ge=1)
    """Recycle after this many runs: refuse new ones, finish those accepted, exit 0 (Kubernetes or the local
    stack then starts a fresh process); None never recycles."""

    @property
    def max_request_bytes(self) -> int:
        """The gRPC receive limit: a program and stdin at their caps, and the rest of the message."""
        return self.max_program_bytes + self.max_stdin_bytes + MESSAGE_OVERHEAD_BYTES

    @property
    def drain_s(self) -> float:
        """Time the last accepted runs may take to finish on a recycle or a stop: the longest deadline allowed
        and the runner's drain after a kill, for each round of queued runs."""
        rounds = 1 + -(-self.max_queued_runs // self.max_concurrent_runs)
        return rounds * (self.max_limits.timeout_s + 2.0) + 1.0

    @model_validator(mode="after")
    def _check(self) -> SandboxPoolConfig:
        if self.sandbox.pool is not None:
            raise ValueError("sandbox.pool: the pool runs programs itself; it cannot send them to another pool")
        problem = above_caps(self.sandbox.limits, self.max_limits)
        if problem is not None:
            raise ValueError(
                f"sandbox.limits (the defaults of a request): {problem.removeprefix('limits.')}; accepted: "
                f"each of {', '.join(LIMIT_FIELDS)} at most its max_limits value"
            )
        return self
