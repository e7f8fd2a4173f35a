"""Confine this process with Landlock and seccomp, then exec the program (the landlock backend's launcher).

Run as a script by the base interpreter (``python -I -B confine.py CONFIG``),
never imported by the caller: it changes its own process for good. CONFIG
is JSON with ``work_dir`` (read-write), ``read_only`` (folders the
interpreter needs), ``seccomp_fd`` (the compiled BPF filter), ``uid`` (the
uid to become when started as root) and ``argv`` (what to exec). In order:
leave root for ``uid``; ask for SIGKILL when the runner dies (after the
change of uid, which clears it: the program's first process dies with its
runner, where bubblewrap's ``--die-with-parent`` takes the whole sandbox);
set no_new_privs; restrict the file system to the two lists (nothing else
of the host is readable: no /proc, /etc, home or checkout); refuse TCP
bind and connect (ABI 4); scope signals and abstract unix sockets to this
sandbox (ABI 6); load the seccomp filter; exec. Any
step that fails exits 121 with the reason on stderr: the program never
runs unconfined. Standard library only.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import NoReturn

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446  # the same on x86-64 and arm64
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
SIGKILL = 9
CONFINE_FAILED = 121

FS_READ = 1 | 4 | 8  # execute, read file, read dir
FS_ALL_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
NET_TCP = 1 | 2  # bind, connect
SCOPE_ALL = 1 | 2  # abstract unix sockets, signals


class RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


class SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def fail(what: str) -> NoReturn:
    sys.stderr.write(f"sandbox: {what}: {os.strerror(ctypes.get_errno())}\n")
    os._exit(CONFINE_FAILED)


def abi_version() -> int:
    return int(libc.syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


def fs_all(abi: int) -> int:
    return FS_ALL_BY_ABI[max(k for k in FS_ALL_BY_ABI if k <= abi)]


def landlock(work_dir: str, read_only: list[str], devices: list[str]) -> None:
    abi = abi_version()
    if abi < 1:
        fail("landlock is not available")
    handled = fs_all(abi)
    attr = RulesetAttr(handled, NET_TCP if abi >= 4 else 0, SCOPE_ALL if abi >= 6 else 0)
    size = ctypes.sizeof(RulesetAttr) if abi >= 4 else 8
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        fail("landlock_create_ruleset")
    rules = [(p, FS_READ) for p in read_only] + [(work_dir, handled)]
    rules += [(d, (2 | 4 | (1 << 14)) & handled) for d in devices]  # write, read, truncate
    for path, access in rules:
        flags = os.O_PATH | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except OSError:
            continue  # a folder this host does not have
        if not os.path.isdir(path):
            access &= 2 | 4 | (1 << 14) | 1
        rule = PathBeneath(access, fd)
        if libc.syscall(SYS_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) < 0:
            fail(f"landlock_add_rule {path}")
        os.close(fd)
    if libc.syscall(SYS_RESTRICT_SELF, ruleset, 0) < 0:
        fail("landlock_restrict_self")
    os.close(ruleset)


def seccomp(fd: int) -> None:
    program = b""
    while chunk := os.read(fd, 1 << 16):
        program += chunk
    os.close(fd)
    buf = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        fail("loading the seccomp filter")


def main() -> None:
    config = json.loads(sys.argv[1])
    runner = os.getppid()
    if os.getuid() == 0:
        uid = config["uid"]
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        except OSError as exc:
            sys.stderr.write(f"sandbox: leaving root: {exc}\n")
            os._exit(CONFINE_FAILED)
    if libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0:
        fail("parent-death signal")
    if os.getppid() != runner:  # the runner died before the signal was asked for: nothing would send it
        os._exit(CONFINE_FAILED)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail("no_new_privs")
    landlock(config["work_dir"], config["read_only"], config["devices"])
    os.chdir(config["work_dir"])
    seccomp(config["seccomp_fd"])
    argv = config["argv"]
    os.execve(argv[0], argv, config["env"])


if __name__ == "__main__":
    main()
