"""``asymptote kube fetch``: a deployed run's results copied out of the
cluster, the way ``kubectl cp`` copies (a tar stream from a command exec'd
in the pod, services/ops/podexec.py), so it needs neither a port-forward nor a path
through the chart's NetworkPolicies.

- from the fitter's pod: ``eval.jsonl``, ``fit.json``, ``curve.png``;
- from learner pod 0 (rank 0): ``metrics.jsonl``;
- with ``model``: ``asymptote export`` run in learner pod 0 on its newest
  checkpoint (or ``step``'s), the model directory copied to ``<to>/model``,
  then removed from the learner's volume.

Both pods keep these in the chart's run volume (``RUN_DIR``). The local
layout is a local run directory's, so ``asymptote fit DIR/eval.jsonl`` and
the model directory work as they do after ``asymptote up``. A file the run
has not written yet is reported, not an error.
"""

from __future__ import annotations

import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asymptote.errors import ConfigError
from services.ops.labels import release_selector
from services.ops.podexec import ExecError, open_exec, run_in_pod

RUN_DIR = "/var/lib/asymptote/run"
"""Where the chart mounts the fitter's and the learner's run volume (templates/fitter.yaml, learner.yaml)."""
FITTER_FILES = ("eval.jsonl", "fit.json", "curve.png")
LEARNER_FILES = ("metrics.jsonl",)
EXPORT_NAME = ".asymptote-fetch-export"
"""The exported model's folder in the learner's run volume while it is copied out."""
MODEL_DIR = "model"
"""Where the exported model goes under the local directory."""

PACK = """\
import os, sys, tarfile
root = sys.argv[1]
with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
    for name in sys.argv[2:]:
        if os.path.lexists(os.path.join(root, name)):
            tar.add(os.path.join(root, name), arcname=name)
"""
"""Writes a tar of the named entries of a folder to stdout, leaving out those that do not exist.

Run by the pod's own Python (every image runs the services on one) rather
than ``tar``, so a file not written yet is simply absent instead of failing the copy.
"""


def pack_command(root: str, names: list[str]) -> list[str]:
    return ["python3", "-c", PACK, root, *names]


def export_command(step: int | None) -> list[str]:
    return ["asymptote", "export", RUN_DIR, "--to", f"{RUN_DIR}/{EXPORT_NAME}"] + (
        ["--step", str(step)] if step is not None else []
    )


@dataclass
class Fetched:
    """What a fetch copied (local path -> bytes) and what the run has not written yet (name -> pod)."""

    to: Path
    files: dict[str, int] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _running_pod(core: Any, namespace: str, selector: str, what: str, name_suffix: str = "") -> Any:
    pods = [
        p
        for p in core.list_namespaced_pod(namespace, label_selector=selector).items
        if p.metadata.name.endswith(name_suffix)
    ]
    running = [p for p in pods if p.status.phase == "Running"]
    if not running:
        seen = ", ".join(f"{p.metadata.name} ({p.status.phase})" for p in pods) or "none"
        raise LookupError(f"no running {what} pod in namespace {namespace!r} (found: {seen})")
    return sorted(running, key=lambda p: p.metadata.name)[0]


def _copy_out(
    core: Any, namespace: str, pod: Any, root: str, names: list[str], into: Path, idle_timeout_s: float
) -> list[Path]:
    """Untar ``names`` of ``root`` in ``pod`` into ``into``; the top-level paths that arrived."""
    container = pod.spec.containers[0].name
    command = open_exec(core, namespace, pod.metadata.name, container, pack_command(root, names), idle_timeout_s)
    arrived: list[Path] = []
    try:
        with tarfile.open(fileobj=command, mode="r|") as tar:
            for member in tar:
                # "data": no absolute paths, no links or paths out of `into`, no device files.
                tar.extract(member, into, filter="data")
                top = into / Path(member.name).parts[0]
                if top not in arrived:
                    arrived.append(top)
    except tarfile.TarError as exc:
        # A command that failed before writing anything sent no archive: its exit status says why.
        command.wait()
        raise ExecError(f"{command.what}: sent no readable tar stream ({exc})") from exc
    command.wait()
    return arrived


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fetch(
    core: Any,
    namespace: str,
    release: str,
    to: Path,
    model: bool = False,
    step: int | None = None,
    idle_timeout_s: float = 120.0,
    export_timeout_s: float = 3600.0,
) -> Fetched:
    """Copy ``release``'s results (and with ``model`` an exported model) into ``to``."""
    if to.exists() and not to.is_dir():
        raise ConfigError(f"--to {to}: exists and is not a directory")
    if model and (to / MODEL_DIR).exists() and any((to / MODEL_DIR).iterdir()):
        raise ConfigError(f"--to {to}: {to / MODEL_DIR} exists and is not empty; --model writes the model there")
    fitter = _running_pod(core, namespace, release_selector(release, "fitter"), "fitter")
    learner = _running_pod(core, namespace, release_selector(release, "learner"), "learner", name_suffix="-0")
    try:
        to.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--to {to}: cannot create it ({exc.strerror})") from exc
    staging = to / ".fetch-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    fetched = Fetched(to)
    try:
        sources = [(fitter, list(FITTER_FILES)), (learner, list(LEARNER_FILES))]
        for pod, names in sources:
            arrived = {p.name for p in _copy_out(core, namespace, pod, RUN_DIR, names, staging, idle_timeout_s)}
            for name in names:
                if name in arrived:
                    (staging / name).replace(to / name)
                    fetched.files[name] = _size(to / name)
                else:
                    fetched.missing[name] = pod.metadata.name
        if model:
            _fetch_model(core, namespace, learner, to, staging, step, idle_timeout_s, export_timeout_s, fetched)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return fetched


def _fetch_model(
    core: Any,
    namespace: str,
    learner: Any,
    to: Path,
    staging: Path,
    step: int | None,
    idle_timeout_s: float,
    export_timeout_s: float,
    fetched: Fetched,
) -> None:
    pod, container = learner.metadata.name, learner.spec.containers[0].name
    export_dir = f"{RUN_DIR}/{EXPORT_NAME}"
    # A fetch interrupted earlier may have left its export: `asymptote export` refuses a non-empty folder.
    run_in_pod(core, namespace, pod, container, ["rm", "-rf", export_dir], idle_timeout_s)
    try:
        # export prints one line at its end and logs to stderr: its stdout stays quiet for as long as it runs.
        run_in_pod(core, namespace, pod, container, export_command(step), export_timeout_s)
        arrived = _copy_out(core, namespace, learner, RUN_DIR, [EXPORT_NAME], staging, idle_timeout_s)
        if not arrived:
            raise ExecError(f"asymptote export in pod {pod} wrote nothing at {export_dir}")
        if (to / MODEL_DIR).exists():  # empty, as fetch checked
            _move_into(staging / EXPORT_NAME, to / MODEL_DIR)
        else:
            (staging / EXPORT_NAME).replace(to / MODEL_DIR)
        fetched.files[MODEL_DIR + "/"] = _size(to / MODEL_DIR)
    finally:
        try:
            run_in_pod(core, namespace, pod, container, ["rm", "-rf", export_dir], idle_timeout_s)
        except ExecError as exc:
            fetched.notes.append(f"the export stays on the learner's volume at {export_dir}: {exc}")


def _move_into(source: Path, dest: Path) -> None:
    """Move the entries of ``source`` into the existing, empty folder ``dest``."""
    for entry in source.iterdir():
        entry.replace(dest / entry.name)


def format_fetched(fetched: Fetched) -> str:
    lines = [f"{fetched.to / name}  {size:,} bytes" for name, size in fetched.files.items()]
    lines += [f"not written yet: {name} (in pod {pod})" for name, pod in fetched.missing.items()]
    lines += [f"note: {note}" for note in fetched.notes]
    return "\n".join(lines)
