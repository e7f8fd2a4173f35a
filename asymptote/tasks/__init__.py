"""Built-in verifiable tasks and their registry (torch-free).

``get_task(name)`` returns a task with default settings; pass settings to
change its parameters. A new task adds a module with a settings model and a
class satisfying ``Task``, and one entry in ``_REGISTRY``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Annotated

from pydantic import BaseModel, Discriminator, Tag, TypeAdapter, ValidationError

from asymptote.tasks.arithmetic import ALPHABET, ArithmeticSettings, ArithmeticTask
from asymptote.tasks.base import Problem, Split, Task
from asymptote.tasks.dataset import DatasetSettings, DatasetTask
from asymptote.tasks.length import LengthControlSettings
from asymptote.tasks.mixture import MixtureEntry, MixtureSettings, MixtureTask
from asymptote.tasks.multiturn import OPERATIONAL_ENVIRONMENT_FIELDS, MultiTurnSettings, MultiTurnTask
from asymptote.tasks.readers import DatasetError

__all__ = [
    "ALPHABET",
    "ArithmeticSettings",
    "ArithmeticTask",
    "DatasetError",
    "DatasetSettings",
    "DatasetTask",
    "LengthControlSettings",
    "MixtureEntry",
    "MixtureSettings",
    "MixtureTask",
    "MultiTurnSettings",
    "MultiTurnTask",
    "Problem",
    "Split",
    "Task",
    "TaskSettings",
    "TaskSettingsValue",
    "get_task",
    "parse_task_settings",
    "task_digest",
    "task_names",
]


def _task_name(value: object) -> str | None:
    # None (no name) is refused by the discriminator with the message below: no kind is assumed.
    name = value.get("name") if isinstance(value, dict) else getattr(value, "name", None)
    return None if name is None else str(name)


TaskSettings = Annotated[
    Annotated[ArithmeticSettings, Tag("arithmetic")]
    | Annotated[DatasetSettings, Tag("dataset")]
    | Annotated[MixtureSettings, Tag("mixture")]
    | Annotated[MultiTurnSettings, Tag("multiturn")],
    Discriminator(
        _task_name,
        custom_error_type="task_name_missing",
        custom_error_message="a task's 'name' (its kind) must be one of arithmetic, dataset, mixture, multiturn",
    ),
]
"""A task's settings; ``name`` picks the task, and a mapping without one is refused."""
TaskSettingsValue = ArithmeticSettings | DatasetSettings | MixtureSettings | MultiTurnSettings
"""A validated ``TaskSettings`` value (for annotations)."""

_ADAPTER: TypeAdapter[TaskSettingsValue] = TypeAdapter(TaskSettings)

_REGISTRY: dict[str, tuple[type[BaseModel], Callable[..., Task]]] = {
    "arithmetic": (ArithmeticSettings, ArithmeticTask),
    "dataset": (DatasetSettings, DatasetTask),
    "mixture": (MixtureSettings, MixtureTask),
    "multiturn": (MultiTurnSettings, MultiTurnTask),
}


def parse_task_settings(value: object) -> TaskSettingsValue:
    """Validated task settings from a mapping (its ``name`` picks the kind); ValidationError if bad."""
    return _ADAPTER.validate_python(value)


OPERATIONAL_FIELDS = frozenset({"num_score_workers", "score_timeout_s"})
"""Task settings that say how a generator runs its scoring, not what a reward means: left out of the digest."""
DIGEST_CHARS = 16
"""Hex characters of a task digest (64 bits: a collision between two tasks of one run is not a concern)."""


def task_digest(settings: TaskSettingsValue) -> str:
    """A stable hash of what a task's rewards mean, which every generation task carries.

    It covers every setting of the task (its kind, verifier, reward style,
    prompt template, system prompt and format, length control, and the
    dataset's identity: the files' paths as written, split, fields, preset,
    held-out choice and seed; the arithmetic task's parameters), with the
    defaults filled in, so values that spell the same settings differently
    hash alike. Left out are OPERATIONAL_FIELDS (scoring workers, the time
    limit of one scoring). The files' contents are not read: the generator
    that checks the digest never opens them. A mixture's digest covers every
    sub-task's settings, name and weight. A multi-turn task's covers its
    dataset's settings and its environment's (the class, its kind and every
    limit; not how many workers host episodes).
    """
    if isinstance(settings, MixtureSettings):
        operational = {"__all__": {"task": set(OPERATIONAL_FIELDS)}}
        values = settings.model_dump(mode="json", exclude={"tasks": operational})
    elif isinstance(settings, MultiTurnSettings):
        values = settings.model_dump(
            mode="json",
            exclude={"dataset": set(OPERATIONAL_FIELDS), "environment": set(OPERATIONAL_ENVIRONMENT_FIELDS)},
        )
    else:
        values = settings.model_dump(mode="json", exclude=set(OPERATIONAL_FIELDS))
    canonical = json.dumps(values, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:DIGEST_CHARS]


def task_names() -> list[str]:
    """Names accepted by ``get_task``."""
    return sorted(_REGISTRY)


def get_task(name: str, settings: BaseModel | None = None) -> Task:
    """The task registered as ``name``, with ``settings`` or its defaults.

    Raises ValueError for an unknown name or settings of another task.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(task_names())}")
    settings_type, factory = _REGISTRY[name]
    if settings is not None and not isinstance(settings, settings_type):
        raise ValueError(f"task {name!r} takes {settings_type.__name__}, got {type(settings).__name__}")
    if settings is None:
        try:
            settings = settings_type()
        except ValidationError as exc:
            raise ValueError(f"task {name!r} has no default settings: {exc}") from None
    return factory(settings)
