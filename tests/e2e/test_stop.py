"""``asymptote up`` and ``asymptote bench`` stopped by SIGTERM mid-run leave no process behind.

Python's default for SIGTERM ends a process without running its ``finally``
blocks, so a command that started services in sessions of their own would
leave them all running (nats-server, broker, fitter, learner ranks,
generators and their vLLM engines). Each command here runs with a marker in
its environment, which every process it starts inherits; after SIGTERM the
command must exit with 130 and no process on the machine may still carry
the marker.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
MARKER = "ASY_TEST_STOP_MARKER"


def marked(token: str) -> list[psutil.Process]:
    """Every live process (zombies aside) whose environment carries ``MARKER=token``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARKER) == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def engine_running(token: str) -> bool:
    """Whether a generator of the run has its vLLM engine process started (the deepest point of the tree)."""
    for proc in marked(token):
        try:
            if "generator" in proc.cmdline() and proc.children():
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["up", "bench"])
def test_sigterm_mid_run_leaves_no_process(command: str, tmp_path: Path) -> None:
    argv = {
        "up": ["up", "--run-dir", str(tmp_path / "run"), "--workload", "arithmetic", "--max-steps", "990"],
        "bench": ["bench", "--output", str(tmp_path / "bench"), "--quick", "--only", "stack"],
    }[command]
    token = secrets.token_hex(8)
    with (tmp_path / "out.log").open("wb") as out:
        main = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *argv],
            cwd=REPO,
            env=dict(os.environ, **{MARKER: token}),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait_until(lambda: engine_running(token) or main.poll() is not None, 300, "a generator's vLLM engine to start")
        assert main.poll() is None, (tmp_path / "out.log").read_text()[-3000:]
        started = {p.pid for p in marked(token)} - {main.pid}
        # nats-server, broker, fitter, learner (torchrun and its rank), generator and its engine
        assert len(started) >= 6, started
        main.send_signal(signal.SIGTERM)
        assert main.wait(timeout=120) == 130, (tmp_path / "out.log").read_text()[-3000:]
        wait_until(lambda: not marked(token), 60, "every process the command started to end")
    finally:
        if main.poll() is None:
            os.killpg(main.pid, signal.SIGKILL)
        for proc in marked(token):
            proc.kill()
