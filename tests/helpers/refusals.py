"""A service command refusing its config at start: exit code 2, no traceback, one line that says why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def refusal(service: str, config: Path) -> str:
    """The one ``asymptote SERVICE: ...`` line ``python -m services.cli SERVICE --config CONFIG`` refuses
    with; AssertionError when it starts, crashes, or says it in other than one such line."""
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", service, "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    refusals = [line for line in proc.stderr.splitlines() if line.startswith(f"asymptote {service}:")]
    assert len(refusals) == 1, proc.stderr
    return refusals[0]
