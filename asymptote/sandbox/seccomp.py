"""The seccomp filter every sandboxed program runs under, compiled to BPF with libseccomp.

Owns the list of system calls a program may not make and the compiled
program (libseccomp through ``pyseccomp``, a ctypes binding with
libseccomp's own Python API). Allow by default, refuse with EPERM what a
test program never needs and an escape does: sockets other than AF_UNIX
(no TCP, UDP, DNS or listening socket even on the sandbox's own loopback),
ptrace and reading other processes' memory, new namespaces (``unshare``,
``setns``, namespace flags to ``clone``), mounts, identity changes, keyrings,
BPF, perf, io_uring (it can open sockets), kernel modules, reboot and kexec.
``kill`` with a negative pid (``kill -1``, another group) is refused;
``setsid`` and ``setpgid`` are refused so every process stays in the group
the runner kills. ``clone3`` answers ENOSYS so the C library falls back to
``clone``, whose flags the filter can read. A system call of another
architecture (int 0x80 on x86-64) kills the process: libseccomp's default
for a foreign architecture.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "mount",
    "umount2",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "setuid",
    "setgid",
    "setreuid",
    "setregid",
    "setresuid",
    "setresgid",
    "setfsuid",
    "setfsgid",
    "setgroups",
    "capset",
    "setsid",
    "setpgid",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "open_by_handle_at",
    "name_to_handle_at",
    "syslog",
    "settimeofday",
    "clock_settime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    "iopl",
    "ioperm",
    "lookup_dcookie",
    "fanotify_init",
    "mknod",
    "mknodat",
)
"""System calls refused with EPERM."""

AF_UNIX = 1
NEGATIVE_PID = 0x80000000
"""The sign bit of a 32-bit pid, however the C library widened it."""
NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its binding) cannot be loaded here."""


@functools.cache
def filter_bpf() -> bytes:
    """The compiled filter as raw BPF (``struct sock_filter`` records), built once per process."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # the binding, or libseccomp.so.2 under it, is missing
        raise SeccompUnavailable(f"pyseccomp cannot load libseccomp: {exc}") from exc
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            f.add_rule(eperm, name)
        except (RuntimeError, ValueError, OSError):
            continue  # a call this architecture does not have (iopl on arm64)
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(eperm, "socket", sc.Arg(0, sc.NE, AF_UNIX))
    # kill(-1) and kill(-pgid): signals to every process the uid may signal, or another group.
    f.add_rule(eperm, "kill", sc.Arg(0, sc.MASKED_EQ, NEGATIVE_PID, NEGATIVE_PID))
    for flag in NAMESPACE_FLAGS.values():
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"libseccomp exported {len(program)} bytes, not whole BPF instructions")
    return program


def bpf_fd() -> int:
    """A file descriptor positioned at the start of the compiled filter (for bwrap's ``--seccomp``)."""
    fd = os.memfd_create("asymptote-seccomp")  # close-on-exec: only pass_fds hands it on
    os.write(fd, filter_bpf())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
