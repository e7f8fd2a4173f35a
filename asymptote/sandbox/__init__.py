"""Running model-written programs where they cannot reach anything: the sandbox (torch-free).

``select_sandbox(settings)`` runs a self-test and returns the first backend
that passes: bubblewrap (namespaces, a read-only runtime, seccomp), then
Landlock with seccomp where user namespaces are missing; with neither,
code tasks are refused unless ``unsafe_no_sandbox`` is set. Each backend's
``run(program, stdin, limits)`` runs one Python program in a process tree
of its own under limits on memory, CPU, processes, file size, open files
and output, and kills the whole tree at the wall-clock deadline. Programs
never run in the caller's process and never see its environment, files or
network. ``sandbox_for`` keeps one selection per settings in a process;
settings that name a sandbox ``pool`` get a ``PoolSandbox`` instead, which
sends each program to ``asymptote sandbox-pool`` over gRPC and returns the
same ``RunResult`` (remote.py).
"""

from __future__ import annotations

import functools

from asymptote.sandbox.limits import (
    BackendChoice,
    BackendName,
    KillReason,
    Limits,
    PoolClientSettings,
    RunResult,
    SandboxSettings,
    sandbox_sections,
    with_pool,
)
from asymptote.sandbox.selftest import Check, Sandbox, SandboxUnavailable, Selection, select_sandbox

__all__ = [
    "BackendChoice",
    "BackendName",
    "Check",
    "KillReason",
    "Limits",
    "PoolClientSettings",
    "RunResult",
    "Sandbox",
    "SandboxSettings",
    "SandboxUnavailable",
    "Selection",
    "sandbox_for",
    "sandbox_sections",
    "select_sandbox",
    "with_pool",
]


@functools.cache
def sandbox_for(settings: SandboxSettings) -> Sandbox:
    """The sandbox ``settings`` select, self-tested once per process; SandboxUnavailable when none passes.
    With a ``pool`` in them, the pool's client: the programs run there, and nothing is self-tested here."""
    if settings.pool is not None:
        from asymptote.sandbox.remote import PoolSandbox

        return PoolSandbox(settings.pool)
    return select_sandbox(settings).sandbox
