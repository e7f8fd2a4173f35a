"""Several tasks in one run, mixed by ratio (ScaleRL trains math and code together).

Owns the ``mixture`` task's settings (a list of named, weighted sub-tasks),
its problems (each sub-task's, with the sub-task's name before the id so
ids stay unique across sub-tasks), which sub-task a problem belongs to, and
the draw that picks the sub-task of the next train prompt.

How a run mixes:

- **Train prompts**: the broker keeps one curriculum per sub-task (its own
  epochs, shuffle and No-Positive-Resampling) and draws which sub-task
  gives the next prompt with ``next_sub_task``: the sub-task furthest below
  its share of the draws so far, ties broken in a seeded order. The draw is
  deterministic, and after any number of draws each sub-task's count is
  within one of its weight's share (no sampling noise in small batches).
- **Scoring**: every generation task names its sub-task (``task_name``);
  a generator scores it with that sub-task's verifier, prompt template and
  length control. The task digest covers the whole mixture, weights
  included.
- **Eval rounds**: one round per sub-task at each eval version, over that
  sub-task's held-out split; the fitter keeps one curve and one fit per
  sub-task.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from asymptote.config import Frozen
from asymptote.tasks.arithmetic import ArithmeticSettings, ArithmeticTask
from asymptote.tasks.base import Problem, Split, Task
from asymptote.tasks.dataset import DatasetSettings, DatasetTask

SUB_TASK_NAME = r"^[a-z][a-z0-9_-]{0,31}$"
"""A sub-task's name: it goes into task ids, eval rows, metric labels and file names."""


def _sub_task_kind(value: object) -> str:
    # As TaskSettings: a mapping without a name is the arithmetic task.
    if isinstance(value, dict):
        return str(value.get("name", "arithmetic"))
    return str(getattr(value, "name", "arithmetic"))


SubTaskSettings = Annotated[
    Annotated[ArithmeticSettings, Tag("arithmetic")] | Annotated[DatasetSettings, Tag("dataset")],
    Discriminator(_sub_task_kind),
]
"""A sub-task's settings: any task but a mixture."""


class MixtureEntry(Frozen):
    """One sub-task of a mixture and its share of the train prompts."""

    name: str = Field(pattern=SUB_TASK_NAME)
    """The sub-task's name (e.g. words, code): in its tasks' task_name, its eval rows and its fit."""
    weight: float = Field(gt=0.0, allow_inf_nan=False)
    """Relative share of train prompts (weights need not sum to 1)."""
    task: SubTaskSettings
    """The sub-task's settings (arithmetic or dataset)."""


class MixtureSettings(Frozen):
    """Several tasks in one run: train prompts drawn by weight, one held-out curve and fit per sub-task."""

    name: Literal["mixture"] = "mixture"
    """Task kind."""
    tasks: tuple[MixtureEntry, ...] = Field(min_length=2)
    """The sub-tasks, each with a name of its own and a weight."""

    @model_validator(mode="after")
    def _unique(self) -> MixtureSettings:
        names = [e.name for e in self.tasks]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"mixture sub-task names must be unique; repeated: {', '.join(repeated)}")
        return self

    def entry(self, name: str) -> MixtureEntry:
        """The sub-task called ``name``; ValueError naming the known ones."""
        for e in self.tasks:
            if e.name == name:
                return e
        raise ValueError(f"no sub-task {name!r} in the mixture (sub-tasks: {', '.join(self.names)})")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.tasks)

    @property
    def weights(self) -> dict[str, float]:
        return {e.name: e.weight for e in self.tasks}


def next_sub_task(weights: Mapping[str, float], counts: Mapping[str, int], seed: int) -> str:
    """The sub-task of the next train prompt, given how many each sub-task has had.

    The one furthest below its share of the draws so far counting this one,
    ``(n + 1) * w / sum(w) - count``; ties go to the sub-task first in an
    order shuffled by ``seed``. Deterministic: the same counts give the same
    answer, so a resumed broker continues the sequence from its saved counts.
    """
    total_weight = sum(weights.values())
    n = sum(counts.get(name, 0) for name in weights)
    order = sorted(weights)
    random.Random(f"{seed}:mixture").shuffle(order)
    rank = {name: i for i, name in enumerate(order)}
    return max(
        weights,
        key=lambda name: ((n + 1) * weights[name] / total_weight - counts.get(name, 0), -rank[name]),
    )


def mixture_prompt_id(sub_task: str, prompt_id: str) -> str:
    """A sub-task's problem id in the mixture: the sub-task's name, then its own id."""
    return f"{sub_task}-{prompt_id}"


class MixtureTask:
    """The sub-tasks' problems together; a problem is scored by its own sub-task."""

    name: str = "mixture"

    def __init__(self, settings: MixtureSettings) -> None:
        self.settings = settings
        self.sub_tasks: dict[str, Task] = {
            e.name: ArithmeticTask(e.task) if isinstance(e.task, ArithmeticSettings) else DatasetTask(e.task)
            for e in settings.tasks
        }
        self._splits: dict[Split, list[Problem]] = {}
        self._sub_of: dict[str, str] = {}

    def sub_problems(self, sub_task: str, split: Split) -> list[Problem]:
        """``sub_task``'s problems of ``split``, with their mixture ids."""
        return [
            Problem(mixture_prompt_id(sub_task, p.prompt_id), p.prompt, p.reference)
            for p in self.sub_tasks[sub_task].problems(split)
        ]

    def problems(self, split: Split) -> Sequence[Problem]:
        """Every sub-task's problems of ``split``, sub-task after sub-task in the settings' order."""
        if split not in self._splits:
            problems = []
            for name in self.sub_tasks:
                sub = self.sub_problems(name, split)
                self._sub_of.update((p.prompt_id, name) for p in sub)
                problems += sub
            self._splits[split] = problems
        return self._splits[split]

    def sub_task_of(self, prompt_id: str) -> str:
        """The sub-task a mixture problem id belongs to; KeyError for an id of no sub-task."""
        if prompt_id not in self._sub_of:
            for name in self.sub_tasks:
                if prompt_id.startswith(f"{name}-"):
                    return name
            raise KeyError(prompt_id)
        return self._sub_of[prompt_id]

    def score_in(self, sub_task: str, completion_text: str, reference: str) -> float:
        """The reward of a completion of one of ``sub_task``'s problems, by that sub-task's rules."""
        return self.sub_tasks[sub_task].score(completion_text, reference)

    def score(self, completion_text: str, reference: str) -> float:
        """Not defined without the sub-task: a mixture's references are its sub-tasks'."""
        raise TypeError("a mixture scores a completion by its sub-task: call score_in(sub_task, ...)")
