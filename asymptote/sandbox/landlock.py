"""The landlock backend: for hosts without unprivileged user namespaces (Ubuntu 24.04 and later).

Owns the landlock backend's runs: a fresh work folder per program (the
only host path it may write, deleted after), and the launcher
(confine.py) that confines itself with Landlock and the same seccomp
filter as bubblewrap before it execs the interpreter. Against bubblewrap it
lacks namespaces: the host's pids exist but ``/proc`` is unreadable; IPC
is the host's. It needs Landlock ABI 6 (signals scoped to the sandbox)
unless it starts as root, when the program runs as a uid of its own
(process.sandbox_uid) and cannot signal the caller's processes anyway; without that it refuses to run.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import tempfile
from pathlib import Path

from asymptote.sandbox.bubblewrap import ENV, PROGRAM_NAME, SANDBOX_UID, interpreter, reachable_by_others
from asymptote.sandbox.limits import BackendName, Limits, RunResult
from asymptote.sandbox.process import run_confined, sandbox_uid
from asymptote.sandbox.seccomp import bpf_fd

LAUNCHER = Path(__file__).with_name("confine.py")
MIN_ABI_UNPRIVILEGED = 6
"""Landlock's signal scoping: without it a program could signal processes of the caller's uid."""
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
WORK_PREFIX = "asy-sbx-"


class LandlockUnavailable(RuntimeError):
    """Landlock is missing or too old here to confine a program."""


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    found = int(libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
    return max(found, 0)


class LandlockSandbox:
    """Runs Python programs under Landlock and seccomp; ``run`` never raises for what the program does."""

    name: BackendName = "landlock"

    def __init__(self, python: Path | None = None) -> None:
        self.python = python
        self.abi = landlock_abi()
        if self.abi < 1:
            raise LandlockUnavailable("the kernel has no Landlock (or it is not in the lsm= list)")
        if self.abi < MIN_ABI_UNPRIVILEGED and os.getuid() != 0:
            raise LandlockUnavailable(
                f"Landlock ABI {self.abi} cannot scope signals (needs {MIN_ABI_UNPRIVILEGED}, Linux 6.12) and this "
                "process is not root, so a program could signal the caller's processes"
            )
        exe, _ = interpreter(python)
        if os.getuid() == 0 and not reachable_by_others(exe):
            raise LandlockUnavailable(
                f"the interpreter {exe} is in a folder a sandbox uid cannot enter; set sandbox.python to one it can "
                "(e.g. /usr/bin/python3)"
            )

    def run(self, program: str, stdin: bytes = b"", limits: Limits | None = None) -> RunResult:
        """Run ``program`` (Python source) with ``stdin`` under ``limits``."""
        limits = limits or Limits()
        exe, roots = interpreter(self.python)
        work = tempfile.mkdtemp(prefix=WORK_PREFIX)
        seccomp_fd = bpf_fd()
        try:
            path = os.path.join(work, PROGRAM_NAME)
            with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
                f.write(program)
            uid = sandbox_uid()
            if uid is not None:
                os.chown(work, uid, uid)
                os.chmod(path, 0o644)
            config = {
                "work_dir": work,
                "read_only": [*roots, "/bin", "/lib", "/lib64", "/sbin"],
                "devices": list(DEVICES),
                "seccomp_fd": seccomp_fd,
                "uid": uid if uid is not None else SANDBOX_UID,
                "env": {**ENV, "HOME": work, "TMPDIR": work},
                "argv": [exe, "-I", "-B", path],
            }
            argv = [exe, "-I", "-B", str(LAUNCHER), json.dumps(config)]
            return run_confined(argv, stdin, limits, "landlock", env={}, cwd=work, pass_fds=(seccomp_fd,))
        finally:
            os.close(seccomp_fd)
            shutil.rmtree(work, ignore_errors=True)
