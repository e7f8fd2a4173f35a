"""``pip install 'asymptote[cli]'`` gives an operator the cluster commands
without torch or vLLM: the extra is installed from PyPI into a fresh venv
(with uv, as scripts/setup.sh installs), and the installed ``asymptote``
then copies a run's results out of the fake Kubernetes API of
test_kube_cli.py (tests/deploy/kube_fake.py; no API server runs here).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest
import test_kube_cli
from chart_render import REPO
from kube_fake import RELEASE, FakeApi
from test_kube_cli import RUN_FILES

from tests.helpers.venvs import install_venv

pytestmark = pytest.mark.slow

api = test_kube_cli.api  # the fake API and its kubeconfig, as test_kube_cli.py serves them
kubeconfig = test_kube_cli.kubeconfig

SOURCES = ("pyproject.toml", "README.md", "asymptote", "services", "benchmarks")
"""What the package is built from: copied, so the build writes nothing into the checkout."""


@pytest.fixture(scope="module")
def cli_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-extra")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    venv = root / "venv"
    done = install_venv(venv, f"{src}[cli]")
    assert done.returncode == 0, done.stderr[-4000:]
    return venv


def test_the_cli_extra_installs_without_torch_or_vllm(cli_venv: Path) -> None:
    python = str(cli_venv / "bin" / "python")
    found = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util as u; "
            "print([m for m in ('torch', 'vllm', 'transformers', 'kubernetes') if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert ast.literal_eval(found.stdout.strip()) == ["kubernetes"]
    helped = subprocess.run(
        [str(cli_venv / "bin" / "asymptote"), "kube", "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0, helped.stderr
    assert "{status,scale,fetch,health}" in helped.stdout
    for command in ("fit", "plan"):
        helped = subprocess.run(
            [str(cli_venv / "bin" / "asymptote"), command, "--help"], capture_output=True, text=True, timeout=60
        )
        assert helped.returncode == 0 and helped.stdout.startswith(f"usage: asymptote {command}"), helped.stderr


def test_the_distribution_claims_only_its_own_top_level_names(cli_venv: Path) -> None:
    # A wheel that installed ``benchmarks`` or ``ops`` would shadow (or be shadowed by) any other
    # distribution of that generic name: the benchmarks run from a checkout, and the operator tools
    # are services/ops/.
    listed = subprocess.run(
        [str(cli_venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.packages_distributions())"],
        capture_output=True,
        text=True,
        check=True,
    )
    by_name: dict[str, list[str]] = ast.literal_eval(listed.stdout.strip())
    assert sorted(name for name, dists in by_name.items() if "asymptote" in dists) == ["asymptote", "services"]
    bench = subprocess.run(
        [str(cli_venv / "bin" / "asymptote"), "bench", "--output", "out"], capture_output=True, text=True, timeout=60
    )
    assert bench.returncode == 2
    assert bench.stderr.strip().count("\n") == 0 and "checkout" in bench.stderr, bench.stderr


def test_the_installed_cli_fetches_a_run(cli_venv: Path, api: FakeApi, kubeconfig: Path, tmp_path: Path) -> None:
    to = tmp_path / "results"
    done = subprocess.run(
        [
            str(cli_venv / "bin" / "asymptote"),
            "kube",
            "fetch",
            RELEASE,
            "--to",
            str(to),
            "--kubeconfig",
            str(kubeconfig),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for name, content in {**RUN_FILES["fitter"], **RUN_FILES["learner"]}.items():
        assert (to / name).read_bytes() == (content if isinstance(content, bytes) else content.encode()), name
