"""Failpoints: parsed strictly, fire once at the armed progress, never again after a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asymptote.faults import parse

SCRIPT = """
import sys
from asymptote.faults import failpoint
for progress in range(10):
    failpoint("demo.point", progress)
    print(progress, flush=True)
"""


def test_parse_names_the_bad_entry() -> None:
    assert parse("") == {}
    assert parse("a.b:3, c:0") == {"a.b": 3, "c": 0}
    for bad in ("a", "a:", ":3", "a:-1", "a:x"):
        with pytest.raises(ValueError, match="is not name:N"):
            parse(bad)


def run(tmp_path: Path, spec: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ASY_FAILPOINTS": spec, "ASY_FAILPOINT_DIR": str(tmp_path / "fp")}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60,
        start_new_session=True,  # the failpoint kills its own process group, as a pod dies whole
    )


def test_failpoint_kills_at_the_armed_progress_then_never_again(tmp_path: Path) -> None:
    first = run(tmp_path, "demo.point:4")
    assert first.returncode == -signal.SIGKILL
    assert first.stdout.split() == ["0", "1", "2", "3"]
    assert (tmp_path / "fp" / "demo.point.fired").read_text().strip() == "4"
    # The restarted process passes the point: it fired once for the run.
    again = run(tmp_path, "demo.point:4")
    assert again.returncode == 0 and again.stdout.split() == [str(i) for i in range(10)]
    # Unarmed points and other names never fire.
    other = run(tmp_path / "other", "another.point:0")
    assert other.returncode == 0 and len(other.stdout.split()) == 10
