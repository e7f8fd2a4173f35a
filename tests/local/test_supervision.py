"""The local stack restarts exited processes as kubelet would: backoff in a crash loop, a fresh start after a good run."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from services.local.config import StackConfig
from services.local.stack import LocalStack
from tests.helpers.waiting import wait_until


def supervise_until(stack: LocalStack, done: Callable[[], bool], timeout_s: float, what: str) -> list[str]:
    """Supervise until ``done()`` or a process is out of restarts (its name is returned); fail after ``timeout_s``."""
    failed: list[str] = []

    def step() -> bool:
        nonlocal failed
        if done():
            return True
        failed = [p.name for p in stack.supervise()[1]]
        return bool(failed)

    wait_until(step, timeout_s, what, interval_s=0.01)
    return failed


def restarts(stack: LocalStack) -> list[dict[str, object]]:
    path = stack.run_dir / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def stack_for(tmp_path: Path, **overrides: object) -> LocalStack:
    config = StackConfig.model_validate(
        {
            "run_dir": tmp_path / "run",
            "nats_auth": False,
            "max_restarts": 3,
            "restart_backoff_s": 0.05,
            "restart_backoff_reset_s": 0.5,
            **overrides,
        }
    )
    stack = LocalStack(config)
    stack.run_dir.mkdir(parents=True)
    return stack


def test_a_crash_loop_backs_off_doubling_then_fails_the_run(tmp_path: Path) -> None:
    # Every run must count as a crash, however slowly the interpreter starts
    # on a loaded machine: the backoff resets only after a minute's run.
    stack = stack_for(tmp_path, restart_backoff_reset_s=60.0)
    proc = stack._spawn("crasher", [sys.executable, "-c", "raise SystemExit(3)"])
    failed = supervise_until(stack, lambda: False, 60.0, "the crash loop to use up its restarts")
    assert failed == ["crasher"]
    rows = restarts(stack)
    assert [r["delay_s"] for r in rows] == [0.05, 0.1, 0.2]
    assert [r["restart"] for r in rows] == [1, 2, 3] and {r["exit_code"] for r in rows} == {3}
    assert proc.restarts == 3 and proc.popen.returncode == 3


def test_a_process_that_ran_well_starts_its_backoff_over(tmp_path: Path) -> None:
    # Each run lasts longer than restart_backoff_reset_s: every exit is a
    # fresh fault, so neither the delay nor the count of restarts in a row
    # grows, and the run goes on past max_restarts exits.
    stack = stack_for(tmp_path, max_restarts=1)
    runs_well = "import time; time.sleep(0.6); raise SystemExit(137)"  # pacing: outlives the 0.5 s reset
    proc = stack._spawn("preempted", [sys.executable, "-c", runs_well])
    failed = supervise_until(
        stack, lambda: proc.restarts >= 3 and proc.popen.poll() is None, 60.0, "the third restart of a good run"
    )
    assert failed == []
    rows = restarts(stack)
    assert len(rows) == 3 and [r["delay_s"] for r in rows] == [0.05, 0.05, 0.05]
    proc.popen.kill()
    proc.popen.wait()


def test_nothing_is_restarted_once_the_stop_began(tmp_path: Path) -> None:
    """A thread that supervises while the stack stops (``follow`` beside a teardown) restarts nothing: the
    services the stop ends stay ended, and ``follow`` returns."""
    stack = stack_for(tmp_path)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    crasher = stack._spawn("crasher", [sys.executable, "-c", "raise SystemExit(3)"])
    # Before the stop, an exit is restarted (the control).
    supervise_until(stack, lambda: crasher.restarts >= 1, 30.0, "a restart before the stop")
    broker = stack._spawn("broker", sleeper)
    stack.stop_services()
    assert broker.popen.poll() is not None  # the stop ended it
    pids = {p.name: p.popen.pid for p in stack.procs}
    for _ in range(5):
        assert stack.supervise() == ([], [])
    wait_until(lambda: crasher.popen.poll() is not None, 30.0, "the crasher's last run to exit")
    assert stack.supervise() == ([], [])
    assert {p.name: p.popen.pid for p in stack.procs} == pids and crasher.restart_at is None
    assert stack.follow() == 130 and stack.progress.outcome == "stopped"
