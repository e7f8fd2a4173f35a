"""Failpoints: parsed strictly, fire once at each armed progress, never again after a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asymptote.faults import Armed, arm, parse
from tests.helpers.waiting import wait_until

SCRIPT = """
import sys
from asymptote.faults import failpoint
for progress in range(10):
    failpoint("demo.point", progress)
    print(progress, flush=True)
"""


def test_parse_names_the_bad_entry() -> None:
    assert parse("") == {}
    assert parse("a.b:3, c:0") == {"a.b": Armed((3,)), "c": Armed((0,))}
    assert parse("a:9,b:1,a:3,a:9,b:file,c:file") == {
        "a": Armed((3, 9)),
        "b": Armed((1,), by_file=True),
        "c": Armed(by_file=True),
    }
    assert parse("a:2:raise,b:file:raise") == {"a": Armed((2,), raises=True), "b": Armed(by_file=True, raises=True)}
    for bad in ("a", "a:", ":3", "a:-1", "a:x", "a:files", "a:3:explode", "a:3:"):
        with pytest.raises(ValueError, match="is not name:N"):
            parse(bad)


def test_a_raising_failpoint_raises_once_where_it_is_armed(tmp_path: Path) -> None:
    script = SCRIPT.replace(
        'failpoint("demo.point", progress)',
        'try:\n        failpoint("demo.point", progress)\n    except RuntimeError as exc:\n        print("raised", exc)',
    )
    env = {**os.environ, "ASY_FAILPOINTS": "demo.point:3:raise", "ASY_FAILPOINT_DIR": str(tmp_path / "fp")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:4] == ["0", "1", "2", "raised failpoint demo.point at 3"] and len(lines) == 11


def run(tmp_path: Path, spec: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ASY_FAILPOINTS": spec, "ASY_FAILPOINT_DIR": str(tmp_path / "fp")}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,  # the failpoint kills its own process group, as a pod dies whole
    )


def test_failpoint_kills_at_the_armed_progress_then_never_again(tmp_path: Path) -> None:
    first = run(tmp_path, "demo.point:4")
    assert first.returncode == -signal.SIGKILL
    assert first.stdout.split() == ["0", "1", "2", "3"]
    assert (tmp_path / "fp" / "demo.point@4.fired").read_text().strip() == "4"
    # The restarted process passes the point: it fired once for the run.
    again = run(tmp_path, "demo.point:4")
    assert again.returncode == 0 and again.stdout.split() == [str(i) for i in range(10)]
    # Unarmed points and other names never fire.
    other = run(tmp_path / "other", "another.point:0")
    assert other.returncode == 0 and len(other.stdout.split()) == 10


def test_a_point_armed_twice_fires_at_each_threshold_once(tmp_path: Path) -> None:
    spec = "demo.point:2,demo.point:6"
    first = run(tmp_path, spec)
    assert first.returncode == -signal.SIGKILL and first.stdout.split() == ["0", "1"]
    # Restarted, the process starts over from progress 0: it passes 2 (fired)
    # and dies at 6.
    second = run(tmp_path, spec)
    assert second.returncode == -signal.SIGKILL and second.stdout.split() == ["0", "1", "2", "3", "4", "5"]
    third = run(tmp_path, spec)
    assert third.returncode == 0 and third.stdout.split() == [str(i) for i in range(10)]
    assert sorted(p.name for p in (tmp_path / "fp").iterdir()) == ["demo.point@2.fired", "demo.point@6.fired"]


def test_thresholds_passed_while_down_fire_one_at_a_time(tmp_path: Path) -> None:
    # A process that first reaches the point past both thresholds dies once
    # per start, for the lowest threshold not yet fired.
    script = SCRIPT.replace("range(10)", "range(7, 10)")
    env = {**os.environ, "ASY_FAILPOINTS": "demo.point:2,demo.point:6", "ASY_FAILPOINT_DIR": str(tmp_path / "fp")}
    outcomes = [
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, start_new_session=True
        )
        for _ in range(3)
    ]
    assert [o.returncode for o in outcomes] == [-signal.SIGKILL, -signal.SIGKILL, 0]
    assert [(tmp_path / "fp" / f"demo.point@{at}.fired").read_text().strip() for at in (2, 6)] == ["7", "7"]


def test_a_point_armed_by_file_fires_when_armed_and_only_then(tmp_path: Path) -> None:
    root = tmp_path / "fp"
    # Runs argv[2] points; the first run has enough for the test to arm it however slowly.
    script = """
import sys, time
from pathlib import Path
from asymptote.faults import failpoint
for progress in range(int(sys.argv[2])):
    failpoint("demo.point", progress)
    print(progress, flush=True)
    if progress == 5:
        Path(sys.argv[1]).touch()  # tell the test we are running
    time.sleep(0.01)  # pacing: a service between two points, not a wait for an event
"""
    env = {**os.environ, "ASY_FAILPOINTS": "demo.point:file", "ASY_FAILPOINT_DIR": str(root)}
    started = tmp_path / "started"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(started), "1000000"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_until(lambda: started.exists() or proc.poll() is not None, 60, "the child to pass point 5")
        assert proc.poll() is None, proc.returncode
        marker = arm(root, "demo.point", "first")
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    fired_at = int(marker.read_text())
    # It ran unharmed until armed, then died at the very next point.
    assert out.split() == [str(i) for i in range(fired_at)] and 6 <= fired_at < 1_000_000
    assert not (root / "demo.point.arm").exists()
    # Unarmed again: a restarted process runs through.
    rerun = subprocess.run(
        [sys.executable, "-c", script, str(started), "40"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )
    assert rerun.returncode == 0 and len(rerun.stdout.split()) == 40
