"""Scoring a mixture of tasks: each generation task by its own sub-task.

Owns the generator's side of a ``mixture`` task (asymptote/tasks/mixture.py):
one ``TaskScorer`` per sub-task, and the dispatch on a generation task's
``task_name``, which names its sub-task. A task's prompt goes through its
sub-task's template, its length control is its sub-task's, and its
completions are judged by its sub-task's verifier, in that sub-task's
scoring pool. The digest a task must carry is the whole mixture's.
"""

from __future__ import annotations

from pathlib import Path

from asymptote.contracts.v1 import rollout_pb2
from asymptote.sandbox import PoolClientSettings
from asymptote.tasks import MixtureSettings, TaskSettingsValue, task_digest
from services.generator.length import LengthControl
from services.generator.metrics import GeneratorMetrics
from services.generator.scoring import TaskScorer


class MixtureScorer:
    """The sub-tasks' scorers, chosen by a task's ``task_name``."""

    def __init__(
        self,
        settings: MixtureSettings,
        model_dir: Path,
        metrics: GeneratorMetrics,
        sandbox_pool: PoolClientSettings | None = None,
    ) -> None:
        self.settings = settings
        self.digest = task_digest(settings)
        """The digest every task this generator takes must carry: the mixture's."""
        self.sub_tasks = {e.name: TaskScorer(e.task, model_dir, metrics, sandbox_pool) for e in settings.tasks}

    def check(self, task: rollout_pb2.GenerationTask) -> None:
        """ValueError for a task of another task (its digest) or of no sub-task of this mixture."""
        if task.task_digest != self.digest:
            theirs = task.task_digest or "none (a broker that sends no digest)"
            raise ValueError(
                f"task {task.task_id} ({task.task_name!r}) carries task digest {theirs}; this generator holds "
                f"{self.digest} (a mixture of {', '.join(self.settings.names)}): the broker and the generators "
                "must be configured with the same task (the chart's top-level `task`)"
            )
        if task.task_name not in self.sub_tasks:
            raise ValueError(
                f"task {task.task_id} names sub-task {task.task_name!r}; this mixture has "
                f"{', '.join(self.settings.names)}"
            )

    def _sub(self, task_name: str) -> TaskScorer:
        return self.sub_tasks[task_name]

    def prompt(self, task_name: str, prompt: str) -> str:
        """The text the engine continues for ``prompt``, through its sub-task's template."""
        sub = self._sub(task_name)
        return sub.prompt(sub.settings.name, prompt)

    def length_control(self, task_name: str) -> LengthControl | None:
        """The sub-task's length control, if it has it on."""
        sub = self._sub(task_name)
        return sub.length_control(sub.settings.name)

    async def rewards(self, task_name: str, completions: list[str], reference: str) -> list[float]:
        """One reward per completion, by the sub-task's verifier."""
        sub = self._sub(task_name)
        return await sub.rewards(sub.settings.name, completions, reference)

    def close(self) -> None:
        for sub in self.sub_tasks.values():
            sub.close()


Scorer = TaskScorer | MixtureScorer
"""What judges a generator's tasks: its one task's scorer, or a mixture's."""


def make_scorer(
    settings: TaskSettingsValue,
    model_dir: Path,
    metrics: GeneratorMetrics,
    sandbox_pool: PoolClientSettings | None = None,
) -> Scorer:
    """The scorer of the configured task: a mixture's dispatches on each task's sub-task."""
    if isinstance(settings, MixtureSettings):
        return MixtureScorer(settings, model_dir, metrics, sandbox_pool)
    return TaskScorer(settings, model_dir, metrics, sandbox_pool)
