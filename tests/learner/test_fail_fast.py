"""Fail fast: an exception mid-step on any rank ends every rank within a minute, non-zero.

Two gloo ranks under torchrun (FSDP2, the GPU layout) take steps as the
learner's do; a failpoint raises in the middle of a step (after the first
micro-batch's backward, its collectives under way) on rank 0, and separately
on rank 1. Every rank must be gone, and torchrun exited non-zero, within
FAIL_FAST_S of the exception: torchrun then restarts the group, which
resumes from the last checkpoint (the service end to end, the ledger
audited: tests/e2e/test_restarts.py). The must-fail twin swallows rank 0's
exception as the learner once did and enters a collective its peer never
enters: the same check must fail. And a wait for data longer than the
collectives' timeout is no failure while rank 0 sends heartbeats; without
them the other rank times out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from services.local import torchrun as launcher
from tests.helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests.learner.failfast_worker"
FAIL_FAST_S = 60.0
TWIN_WAIT_S = 10.0
"""How long the twin is watched: a hang shows within it (a fail-fast exit measured takes about 1 s)."""


def launch(out: Path, fail_rank: int | None, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    out.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "ASY_FAILPOINTS": "" if fail_rank is None else f"learner.step.backward.rank{fail_rank}:2:raise",
        "ASY_FAILPOINT_DIR": str(out / "failpoints"),
    }
    proc = subprocess.Popen(
        launcher.command(2, "-m", WORKER, "--out", str(out), *args),
        env=env,
        stdout=(out / "log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, out / "failpoints" / f"learner.step.backward.rank{fail_rank}@2.fired"


def exits_within(proc: subprocess.Popen[bytes], marker: Path, deadline_s: float) -> float:
    """Seconds from the injected exception to the launch's end; AssertionError when it outlives
    ``deadline_s`` or ends with status 0."""
    wait_until(lambda: marker.exists() or proc.poll() is not None, 120, "the failpoint to fire")
    assert marker.exists(), f"the launch ended before the failpoint fired (status {proc.returncode})"
    fired = marker.stat().st_mtime
    try:
        proc.wait(timeout=max(0.0, fired + deadline_s - time.time()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ranks still running {deadline_s:.0f}s after the exception") from None
    assert proc.returncode != 0, "the launch ended as if nothing failed"
    return time.time() - fired


def stop(proc: subprocess.Popen[bytes], out: Path) -> None:
    """End the launch and its ranks: torchrun starts each rank in a session of its own, so killing its
    group leaves a rank stuck in a collective running until the collective's timeout."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for path in out.glob("pid.rank*"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(path.read_text()), signal.SIGKILL)
    wait_until(
        lambda: not [p for p in out.glob("pid.rank*") if Path(f"/proc/{p.read_text()}").exists()],
        30,
        "every rank to end",
    )


@pytest.mark.slow  # torchrun
@pytest.mark.parametrize("fail_rank", [0, 1])
def test_an_exception_on_any_rank_ends_every_rank(tmp_path: Path, fail_rank: int) -> None:
    proc, marker = launch(tmp_path / "run", fail_rank)
    try:
        took = exits_within(proc, marker, FAIL_FAST_S)
    finally:
        stop(proc, tmp_path / "run")
    print(f"rank {fail_rank} raised: every rank gone {took:.1f}s later")
    pids = [int(p.read_text()) for p in (tmp_path / "run").glob("pid.rank*")]
    assert len(pids) == 2 and not [pid for pid in pids if Path(f"/proc/{pid}").exists()]


@pytest.mark.slow  # torchrun
def test_the_check_fails_when_rank0_swallows_the_exception(tmp_path: Path) -> None:
    proc, marker = launch(tmp_path / "run", 0, "--swallow")
    try:
        with pytest.raises(AssertionError, match="still running"):
            exits_within(proc, marker, TWIN_WAIT_S)
    finally:
        stop(proc, tmp_path / "run")


@pytest.mark.slow  # torchrun
@pytest.mark.parametrize("heartbeat_s", [1.0, 0.0], ids=["heartbeats", "silent"])
def test_a_wait_for_data_longer_than_the_timeout_is_no_failure_with_heartbeats(
    tmp_path: Path, heartbeat_s: float
) -> None:
    timeout_s = 5.0
    proc, _ = launch(
        tmp_path / "run",
        None,
        *("--wait-s", str(3 * timeout_s), "--heartbeat-s", str(heartbeat_s), "--timeout-s", str(timeout_s)),
    )
    try:
        proc.wait(timeout=120)
    finally:
        stop(proc, tmp_path / "run")
    log = (tmp_path / "run" / "log").read_text(errors="replace")
    if heartbeat_s:
        assert proc.returncode == 0, log[-3000:]
    else:  # the other rank's collective timed out (gloo's words for it): the launch failed
        assert proc.returncode != 0 and "Timed out waiting" in log, log[-3000:]
