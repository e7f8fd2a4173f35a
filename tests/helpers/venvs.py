"""Fresh virtual environments for tests that need packages apart from the project's (checkov, whose pins
clash with ours; the CLI extra, installed without torch): made with uv, as scripts/setup.sh installs, so a
venv takes seconds from uv's cache where pip took one to two minutes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def install_venv(venv: Path, *requirements: str, timeout_s: float = 900.0) -> subprocess.CompletedProcess[str]:
    """A new venv at ``venv`` (emptied if there) holding ``requirements``; the installer's result, which the
    caller checks. The local wheel folders pip is told of (PIP_FIND_LINKS) are passed on, as set-up does."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
    links = [arg for link in os.environ.get("PIP_FIND_LINKS", "").split() for arg in ("--find-links", link)]
    python = str(venv / "bin" / "python")
    return subprocess.run(
        [sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python", python, *links, *requirements],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
