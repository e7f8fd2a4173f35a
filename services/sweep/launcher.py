"""Launchers: how a sweep starts, stops, pauses, resumes and watches its runs.

Owns the processes of a sweep's runs, not their decisions (``controller.py``). One interface
(``Launcher``) and, here, one kind: ``LocalLauncher``, each run an ``asymptote up --config
DIR/runs/<run>/config.yaml`` subprocess with its own run directory and NATS prefix (one shared
nats-server for the sweep, ``SharedNats``). Pause is a clean stop (SIGTERM, as Kubernetes stops a pod: the run writes its
checkpoint, ledger and summary.json; not SIGINT, which a shell's background job inherits ignored), asked for without waiting and escalated to SIGKILL when asked again past the grace; resume is
``asymptote up --resume RUN_DIR``.

A run's process is recorded in ``DIR/runs/<run>/process.json`` as its pid and its start time (field 22
of ``/proc/<pid>/stat``, clock ticks since boot), so that a controller restarted after SIGKILL adopts a
run that is still alive, resumes one that died, and never takes a reused pid for the run. A run whose
record was never written (the controller killed between the start and the record) is found by its
command line, which names its own config file. Linux-only (``/proc``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

log = logging.getLogger(__name__)

RunStatus = Literal["running", "exited", "absent"]
"""A run's process: alive, started once and now gone, or never started."""

STOP_GRACE_S = 60.0
"""How long a clean stop (SIGTERM) may take before the run is killed: its checkpoint's write and ledger audit."""


@dataclass(frozen=True)
class RunPaths:
    """Where one run of a sweep keeps its files: ``DIR/runs/<arm>-s<seed>/``."""

    root: Path

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def config(self) -> Path:
        """The run's StackConfig as ``asymptote up --config`` takes it."""
        return self.root / "config.yaml"

    @property
    def run_dir(self) -> Path:
        """The run's own run directory (eval.jsonl, summary.json, checkpoints)."""
        return self.root / "run"

    @property
    def process(self) -> Path:
        """The launcher's record of the run's live process: pid and start time."""
        return self.root / "process.json"

    @property
    def log(self) -> Path:
        """The run's stdout and stderr, appended across its starts."""
        return self.root / "launcher.log"


class Launcher(Protocol):
    """What a controller needs of a place that runs a sweep's runs."""

    def start(self, run: RunPaths) -> None:
        """Start the run from its config."""

    def stop(self, run: RunPaths) -> None:
        """Ask the run to stop for good (a clean stop; it is not resumed) and return at once; called again
        while it lives, escalate past the grace."""

    def pause(self, run: RunPaths) -> None:
        """Ask the run to stop cleanly, keeping its checkpoint, to resume later; returns at once."""

    def resume(self, run: RunPaths) -> None:
        """Continue a paused or dead run from its checkpoint."""

    def status(self, run: RunPaths) -> RunStatus:
        """Whether the run's process is alive, gone, or never started."""

    def close(self) -> None:
        """Let go of the runs' processes (they keep running, to be adopted)."""


def process_start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or None when there is no live process
    (absent, or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after its closing one.
    fields = text[text.rindex(")") + 2 :].split()
    state, start_ticks = fields[0], int(fields[19])
    return None if state in ("Z", "X") else start_ticks


def _find_by_command(needle: str) -> tuple[int, int] | None:
    """A live process whose command line holds ``needle`` as one argument: (pid, start ticks)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle.encode() in args:
            ticks = process_start_ticks(int(entry.name))
            if ticks is not None:
                return int(entry.name), ticks
    return None


def asymptote_up(run: RunPaths, resume: bool) -> list[str]:
    """The command of a run: ``asymptote up --config CONFIG``, or ``--resume RUN_DIR`` to continue it."""
    head = [sys.executable, "-m", "services.cli", "up"]
    return [*head, "--resume", str(run.run_dir)] if resume else [*head, "--config", str(run.config)]


class LocalLauncher:
    """Runs on this machine, each a subprocess in a session of its own (a Ctrl-C of the controller leaves
    them running, to be adopted when it restarts).

    ``command`` builds a run's argv (``asymptote_up`` unless given); its argv must name the run's config
    file or run directory as one argument, which is how a run without a process record is found.
    """

    def __init__(
        self, command: Callable[[RunPaths, bool], list[str]] = asymptote_up, grace_s: float = STOP_GRACE_S
    ) -> None:
        self.command = command
        self.grace_s = grace_s
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._asked: dict[str, float] = {}

    def _record(self, run: RunPaths) -> tuple[int, int] | None:
        try:
            raw = json.loads(run.process.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        return int(raw["pid"]), int(raw["start_ticks"])

    def _live_pid(self, run: RunPaths) -> int | None:
        child = self._children.get(run.name)
        if child is not None:
            return child.pid if child.poll() is None else None
        recorded = self._record(run)
        if recorded is not None:
            pid, ticks = recorded
            # A pid the kernel reused for another process has another start time.
            return pid if process_start_ticks(pid) == ticks else None
        for needle in (str(run.config), str(run.run_dir)):
            found = _find_by_command(needle)
            if found is not None:
                self._write_record(run, *found)
                return found[0]
        return None

    def _write_record(self, run: RunPaths, pid: int, ticks: int) -> None:
        tmp = run.process.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": pid, "start_ticks": ticks}), encoding="utf-8")
        os.replace(tmp, run.process)

    def _spawn(self, run: RunPaths, resume: bool) -> None:
        if self._live_pid(run) is not None:
            raise RuntimeError(f"run {run.name} is already running; it is not started twice")
        argv = self.command(run, resume)
        with run.log.open("ab") as out:
            child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._children[run.name] = child
        self._asked.pop(run.name, None)
        ticks = process_start_ticks(child.pid)
        if ticks is not None:
            self._write_record(run, child.pid, ticks)
        log.info("run %s: %s (pid %d)", run.name, " ".join(argv[-2:]), child.pid)

    def start(self, run: RunPaths) -> None:
        self._spawn(run, resume=False)

    def resume(self, run: RunPaths) -> None:
        self._spawn(run, resume=True)

    def pause(self, run: RunPaths) -> None:
        """Ask the run for a clean stop (SIGTERM) and return; asked again past ``grace_s``, kill its process group."""
        pid = self._live_pid(run)
        if pid is None:
            self._asked.pop(run.name, None)
            return
        asked = self._asked.get(run.name)
        if asked is None:
            self._asked[run.name] = time.monotonic()
            os.kill(pid, signal.SIGTERM)
        elif time.monotonic() - asked >= self.grace_s:
            log.warning("run %s: no clean stop in %.0f s, killed", run.name, self.grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # its session's group: what it started and left there too

    def stop(self, run: RunPaths) -> None:
        self.pause(run)

    def status(self, run: RunPaths) -> RunStatus:
        if self._live_pid(run) is not None:
            return "running"
        return "exited" if run.process.exists() or run.name in self._children else "absent"

    def close(self) -> None:
        """Reap this launcher's exited children (the live ones keep running)."""
        for child in self._children.values():
            child.poll()


class SharedNats:
    """The one nats-server (JetStream) a sweep's runs share, each under its own prefix.

    Started in ``DIR/nats`` on a port kept in ``DIR/nats.json`` with its pid and start time; it outlives
    the controller (a controller killed mid-sweep leaves its runs connected), is adopted by a restarted
    one while it lives, and is started again on the same port and store when it does not (the file store
    keeps every stream). Stopped when the sweep ends.
    """

    def __init__(self, directory: Path) -> None:
        self.store = directory / "nats"
        self.record = directory / "nats.json"
        self.process: subprocess.Popen[bytes] | None = None

    def _recorded(self) -> dict[str, int] | None:
        try:
            raw = json.loads(self.record.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        return {k: int(raw[k]) for k in ("pid", "start_ticks", "port")}

    def pid(self) -> int | None:
        """The live server's pid, or None."""
        held = self._recorded()
        if held is None or process_start_ticks(held["pid"]) != held["start_ticks"]:
            return None
        return held["pid"]

    def ensure(self) -> str:
        """The server's URL, started (or started again) first when it is not alive."""
        from asymptote.nats_local import free_port, start_nats

        held = self._recorded()
        port = held["port"] if held is not None else free_port()
        if self.pid() is None:
            server = start_nats(self.store, port, self.store / "nats-server.log", outlive_parent=True)
            self.process = server.process
            ticks = process_start_ticks(server.process.pid)
            tmp = self.record.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": server.process.pid, "start_ticks": ticks, "port": port}))
            os.replace(tmp, self.record)
            log.info("nats-server for the sweep on port %d (pid %d)", port, server.process.pid)
        return f"nats://127.0.0.1:{port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL past ``timeout_s``); nothing when it is not alive."""
        pid = self.pid()
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while process_start_ticks(pid) is not None:
            if self.process is not None and self.process.poll() is not None:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                deadline = math.inf
            time.sleep(0.05)
        if self.process is not None:
            self.process.wait()
