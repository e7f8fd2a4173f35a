"""The embedded workloads: stack configs kept as files, examples/workloads/<name>.yaml.

Owns finding a workload by name, listing the ones there are and reading one
into the StackConfig fields it sets, with its relative paths resolved against
the checkout (so a workload runs the same from any working directory, and a
copy of its file run from the checkout with ``--config`` reads the same
data). Adding a workload is adding a file; a task of a kind the embedded
recipe has no warm-start format for also needs one in services/embedded/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from asymptote.errors import ConfigError
from asymptote.tasks import TaskSettingsValue, parse_task_settings

CHECKOUT = Path(__file__).resolve().parents[2]
"""The folder relative paths in a workload file are read against."""
WORKLOADS_DIR = CHECKOUT / "examples" / "workloads"
DEFAULT_WORKLOAD = "words"
"""What ``asymptote up`` runs when neither ``--workload`` nor a config names one."""
PATH_FIELDS = ("path", "eval_path")
"""Task fields that name files (a dataset task's, at any depth of a mixture or multi-turn task)."""


def workload_names() -> list[str]:
    """Every workload there is, by name."""
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))


def workload(name: str) -> dict[str, Any]:
    """The StackConfig fields workload ``name`` sets; ConfigError naming the ones there are if it is not one."""
    path = WORKLOADS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"workload {name!r}: no {path.name} in {WORKLOADS_DIR}; accepted: {', '.join(workload_names())}"
        )
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"workload {name!r}: {path} is not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"workload {name!r}: {path} must hold a mapping of stack config fields")
    if "workload" in data:
        raise ConfigError(f"workload {name!r}: {path} names a workload itself; a workload file sets fields only")
    if isinstance(data.get("task"), dict):
        data["task"] = _resolved(data["task"])
    return data


def workload_task(name: str) -> TaskSettingsValue:
    """The task of workload ``name``, validated."""
    return parse_task_settings(workload(name)["task"])


def _resolved(mapping: dict[str, Any]) -> dict[str, Any]:
    """``mapping`` with every relative file path of a task (at any depth) made absolute under the checkout."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if key in PATH_FIELDS and isinstance(value, str) and not Path(value).is_absolute():
            out[key] = str(CHECKOUT / value)
        elif isinstance(value, dict):
            out[key] = _resolved(value)
        elif isinstance(value, list):
            out[key] = [_resolved(v) if isinstance(v, dict) else v for v in value]
        else:
            out[key] = value
    return out
