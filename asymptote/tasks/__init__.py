"""Built-in verifiable tasks and their registry (torch-free).

``get_task(name)`` returns a task with default settings; pass settings to
change its parameters. A new task adds a module with a settings model and a
class satisfying ``Task``, and one entry in ``_REGISTRY``.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel

from asymptote.tasks.arithmetic import ALPHABET, ArithmeticSettings, ArithmeticTask
from asymptote.tasks.base import Problem, Split, Task

__all__ = [
    "ALPHABET",
    "ArithmeticSettings",
    "ArithmeticTask",
    "Problem",
    "Split",
    "Task",
    "TaskSettings",
    "get_task",
    "task_names",
]

# One member today; becomes Annotated[A | B, Field(discriminator="name")]
# when a second task exists.
TaskSettings = ArithmeticSettings

_REGISTRY: dict[str, tuple[type[BaseModel], Callable[..., Task]]] = {
    "arithmetic": (ArithmeticSettings, ArithmeticTask),
}


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
    return factory(settings) if settings is not None else factory()
