"""Fixtures of the deployment tests: the chart rendered per value set, checkov
in its own venv, Debian's Prometheus.

No Kubernetes API server runs on these machines: the chart is proven by
rendering, linting, schema validation, validating every object against the
Kubernetes schemas, a policy scan and, for the dashboard, a real Prometheus.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from chart_render import REPO, VALUE_SETS, Rendered, render, render_stack
from filelock import FileLock

from tests.helpers.venvs import install_venv


@pytest.fixture(params=sorted(VALUE_SETS), scope="session")
def value_set(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def rendered(value_set: str) -> Rendered:
    return render(value_set)


# -- checkov in its own venv ------------------------------------------------

CHECKOV_VENV = REPO / ".cache" / "checkov-venv"


@pytest.fixture(scope="session")
def checkov() -> Path:
    """The checkov CLI, installed once into .cache/checkov-venv (its pins clash with the project's)."""
    exe = CHECKOV_VENV / "bin" / "checkov"
    CHECKOV_VENV.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{CHECKOV_VENV}.lock"):  # parallel workers: one installs, the others wait for it
        if not exe.exists():
            install_checkov()
    return exe


def install_checkov() -> None:
    install = install_venv(CHECKOV_VENV, "checkov>=3.2")
    assert install.returncode == 0, f"cannot install checkov into {CHECKOV_VENV}:\n{install.stderr[-3000:]}"


# -- Prometheus from Debian ----------------------------------------------------


@pytest.fixture(scope="session")
def prometheus_binary() -> Iterator[str]:
    """Debian's prometheus, installed on first use; fails (never skips) if it cannot be."""
    (REPO / ".cache").mkdir(exist_ok=True)
    with FileLock(str(REPO / ".cache" / "prometheus-install.lock")):  # parallel workers: apt-get once
        install_prometheus()
    yield str(shutil.which("prometheus"))


def install_prometheus() -> None:
    if shutil.which("prometheus") is None:
        sudo = [] if _is_root() else ["sudo", "-n"]
        apt = [*sudo, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]
        log = []
        for args in (["update"], ["install", "-y", "--no-install-recommends", "prometheus"]):
            result = subprocess.run([*apt, *args], capture_output=True, text=True)
            log.append(f"$ apt-get {' '.join(args)}: exit {result.returncode}\n{result.stderr[-1500:]}")
        assert shutil.which("prometheus"), "Debian's prometheus package could not be installed:\n" + "\n".join(log)


def _is_root() -> bool:
    return os.geteuid() == 0


@pytest.fixture(scope="session")
def stack_rendered(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    return render_stack(tmp_path_factory.mktemp("stack"))
