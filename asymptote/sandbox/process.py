"""Running one confined command from outside: limits, output caps, the deadline, the kill.

Owns what every backend does the same way once it has built its command
line: the resource limits (through util-linux's ``prlimit`` in front of the
command, so nothing runs as Python code between fork and exec in the
caller), a new session whose process group is the unit that is killed,
reading stdout and stderr up to a cap, and the wall-clock deadline. The
program's exit is watched through a pidfd without reaping it, so its
process group id cannot be reused before the group is killed; the group is
killed at the deadline, at the output cap, and after every exit (a child
left behind dies with it). Knows nothing about namespaces or seccomp.
"""

from __future__ import annotations

import itertools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from asymptote.sandbox.limits import BackendName, KillReason, Limits, RunResult

CHUNK_BYTES = 1 << 16
DRAIN_S = 2.0
"""How long the pipes may stay open after the kill (the last processes of a killed tree dying)."""

SANDBOX_UID_BASE = 100_000
NUM_SANDBOX_UIDS = 50_000
_uid_counter = itertools.count()


def sandbox_uid() -> int | None:
    """A uid of its own for one run when this process is root (None otherwise).

    RLIMIT_NPROC counts a uid's processes host-wide and never binds uid 0,
    so a root caller runs each program under a uid from a range nothing else
    uses; two runs sharing one by chance only share their process budget.
    """
    if os.getuid() != 0:
        return None
    return SANDBOX_UID_BASE + (os.getpid() * 7919 + next(_uid_counter)) % NUM_SANDBOX_UIDS


def processes_of(uid: int) -> int:
    """How many processes ``uid`` runs now (RLIMIT_NPROC counts them all)."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                continue  # gone meanwhile
    return count


_RLIMIT = {
    "as": resource.RLIMIT_AS,
    "cpu": resource.RLIMIT_CPU,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
    "core": resource.RLIMIT_CORE,
}


def prlimit_path() -> str | None:
    """util-linux's prlimit, or None where it is missing."""
    return shutil.which("prlimit") or next(
        (p for p in ("/usr/bin/prlimit", "/bin/prlimit") if os.access(p, os.X_OK)), None
    )


def with_limits(argv: Sequence[str], limits: Limits, user: int | None) -> tuple[list[str], Callable[[], None] | None]:
    """``argv`` with its limits applied: prlimit in front, or (without prlimit) a preexec function.

    Run as this (non-root) user, the process limit is what the user runs
    already plus the program's own allowance.
    """
    found = prlimit_path()
    values = limits.rlimits()
    if user is None and os.getuid() != 0:
        values["nproc"] += processes_of(os.getuid())
    if found is not None:
        return [found, *(f"--{name}={value}" for name, value in values.items()), "--", *argv], None

    def preexec() -> None:  # only where prlimit is missing: runs between fork and exec
        for name, value in values.items():
            resource.setrlimit(_RLIMIT[name], (value, value))

    return list(argv), preexec


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def run_confined(
    argv: Sequence[str],
    stdin: bytes,
    limits: Limits,
    backend: BackendName,
    env: dict[str, str],
    cwd: str | None = None,
    pass_fds: Sequence[int] = (),
    user: int | None = None,
) -> RunResult:
    """Run ``argv`` with ``limits`` in a new session, feed it ``stdin``, and report how it ended.

    The process group is killed at ``limits.timeout_s``, when stdout or
    stderr passes ``limits.output_bytes``, and once the program has exited.
    ``user`` (a root caller's ``sandbox_uid``) is the uid it starts as.
    """
    command, preexec = with_limits(argv, limits, user)
    start = time.monotonic()
    deadline = start + limits.timeout_s
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        pass_fds=tuple(pass_fds),
        start_new_session=True,
        preexec_fn=preexec,
        close_fds=True,
        user=user,
        group=user,
        extra_groups=() if user is not None else None,
    )
    pgid = proc.pid  # the session leader's pid is its group id
    pidfd = os.pidfd_open(proc.pid)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    total = dict.fromkeys(kept, 0)
    pending = memoryview(stdin)
    stdin_fd = proc.stdin.fileno()
    os.set_blocking(stdin_fd, False)
    killed: KillReason | None = None
    exited = False
    with selectors.DefaultSelector() as sel:
        for fd in kept:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(pidfd, selectors.EVENT_READ)
        if pending:
            sel.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while len(sel.get_map()) > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                killed = "timeout"
                break
            for key, _ in sel.select(left):
                fd = key.fd
                if fd == pidfd:
                    exited = True
                    sel.unregister(pidfd)
                    _kill_group(pgid)  # what it left behind dies with it
                elif fd == stdin_fd:
                    try:
                        written = os.write(stdin_fd, pending[:CHUNK_BYTES])
                    except (BrokenPipeError, BlockingIOError) as exc:
                        written = len(pending) if isinstance(exc, BrokenPipeError) else 0
                    pending = pending[written:]
                    if not pending:
                        sel.unregister(stdin_fd)
                        proc.stdin.close()
                else:
                    data = os.read(fd, CHUNK_BYTES)
                    if not data:
                        sel.unregister(fd)
                        continue
                    total[fd] += len(data)
                    room = limits.output_bytes - len(kept[fd])
                    kept[fd] += data[:room]
                    if total[fd] > limits.output_bytes:
                        killed = "output_limit"
            if killed is not None:
                break
        if killed is not None or not exited:
            _kill_group(pgid)
        # The pipes close once the last process holding them is dead.
        drain_until = time.monotonic() + DRAIN_S
        for key in list(sel.get_map().values()):
            if key.fd in kept:
                continue
            sel.unregister(key.fd)
        while sel.get_map() and time.monotonic() < drain_until:
            for key, _ in sel.select(drain_until - time.monotonic()):
                data = os.read(key.fd, CHUNK_BYTES)
                if not data:
                    sel.unregister(key.fd)
                    continue
                total[key.fd] += len(data)
                kept[key.fd] += data[: limits.output_bytes - len(kept[key.fd])]
    os.close(pidfd)
    if not proc.stdin.closed:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
    returncode = proc.wait()
    elapsed = time.monotonic() - start
    proc.stdout.close()
    proc.stderr.close()
    out_fd, err_fd = list(kept)
    return RunResult(
        backend=backend,
        exit_code=returncode if returncode >= 0 else None,
        signal=-returncode if returncode < 0 else None,
        killed=killed,
        stdout=bytes(kept[out_fd]),
        stderr=bytes(kept[err_fd]),
        stdout_bytes=total[out_fd],
        time_s=elapsed,
    )
