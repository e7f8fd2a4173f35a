"""Prompts and rewards for the tasks a generator serves.

Owns the generator's side of a task: the configured dataset task's prompts
go through its template (the chat template of the model's own tokenizer,
or the plain one) and its completions through a ``ScoringPool`` with a
per-completion time limit, each verdict counted by reason. The built-in
arithmetic task is scored in this process, its prompt sent as it is. A
dataset task with a thinking budget is sampled under interruption length
control (length.py).

A generator serves the one task it is configured with: a task message
whose task digest (``asymptote.tasks.task_digest``) is not this task's is
refused by :meth:`TaskScorer.check`, since scoring it here would judge it
by another task's rules.

A multi-turn task's prompt is the dataset's prompt format filled in (the
environment writes the messages the chat template renders), and the final
turns of the episodes that end with no reward from their environment are
judged by its dataset's verifier, in the same pool.

A code task's programs run in a sandbox pool when the generator names one
(``sandbox_pool``): its verifier settings are the task's with the pool in
their ``sandbox`` section, so the verifier's path and verdicts are the
same either way, and the task digest is the task's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import ConfigError
from asymptote.sandbox import PoolClientSettings, SandboxUnavailable, sandbox_for, sandbox_sections, with_pool
from asymptote.tasks import ArithmeticSettings, DatasetSettings, MultiTurnSettings, Task, get_task, task_digest
from asymptote.tasks.multiturn import episode_prompt
from asymptote.tasks.prompts import render_prompt
from asymptote.tasks.verifiers import reward
from asymptote.tasks.verifiers.pool import ScoringPool
from services.generator.length import LengthControl
from services.generator.metrics import GeneratorMetrics


class TaskScorer:
    def __init__(
        self,
        settings: ArithmeticSettings | DatasetSettings | MultiTurnSettings,
        model_dir: Path,
        metrics: GeneratorMetrics,
        sandbox_pool: PoolClientSettings | None = None,
    ) -> None:
        self.settings = settings
        self.sandbox_pool = sandbox_pool
        """Where a code verifier's programs run (None: this machine's sandbox)."""
        self.digest = task_digest(settings)
        """The digest every task this generator takes must carry."""
        self.model_dir = model_dir
        self.metrics = metrics
        self._tasks: dict[str, Task] = {}
        self._pool: ScoringPool | None = None
        self._tokenizer: Any = None
        self._length: LengthControl | None = None

    def check(self, task: rollout_pb2.GenerationTask) -> None:
        """ValueError, naming both digests, for a task whose digest is not this generator's task's."""
        if task.task_digest != self.digest:
            theirs = task.task_digest or "none (a broker that sends no digest)"
            raise ValueError(
                f"task {task.task_id} ({task.task_name!r}) carries task digest {theirs}; this generator holds "
                f"{self.digest} ({self.settings.name!r}): the broker and the generators must be configured "
                "with the same task (the chart's top-level `task`)"
            )

    def _dataset(self, task_name: str) -> DatasetSettings | None:
        """The dataset settings that judge ``task_name``'s completions: the configured dataset task's, or its
        multi-turn task's dataset; None for any other task."""
        s = self.settings
        if task_name != s.name:
            return None
        if isinstance(s, MultiTurnSettings):
            return s.dataset
        return s if isinstance(s, DatasetSettings) else None

    def prompt(self, task_name: str, prompt: str) -> str:
        """The text the engine continues for ``prompt`` (a multi-turn task's: what its environment gets)."""
        if isinstance(self.settings, MultiTurnSettings) and task_name == self.settings.name:
            return episode_prompt(self.settings, prompt)
        if not isinstance(self.settings, DatasetSettings) or task_name != self.settings.name:
            return prompt
        return render_prompt(prompt, self.settings, self.tokenizer() if self.settings.template == "chat" else None)

    def tokenizer(self) -> Any:
        """The model's own tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        return self._tokenizer

    def length_control(self, task_name: str) -> LengthControl | None:
        """The configured dataset task's length control (a multi-turn task's: its dataset's, an episode's
        budget), if it is on; None for any other task."""
        s = self._dataset(task_name)
        if s is None or not s.length_control.enabled:
            return None
        if self._length is None:
            phrase = s.length_control.interruption_phrase
            self._length = LengthControl(s.length_control, self.tokenizer().encode(phrase, add_special_tokens=False))
        return self._length

    async def rewards(self, task_name: str, completions: list[str], reference: str) -> list[float]:
        """One reward per completion; a dataset task's are judged in the pool, within its time limit."""
        s = self._dataset(task_name)
        if s is not None:
            if self._pool is None:
                verifier = with_pool(s.verifier, self.sandbox_pool)
                self._pool = ScoringPool(verifier, s.num_score_workers, s.score_timeout_s)
            verdicts = await self._pool.judge_all(completions, reference)
            for v in verdicts:
                self.metrics.verdicts.labels(v.reason).inc()
            return [reward(v, s.reward_style) for v in verdicts]
        configured = self.settings
        if task_name not in self._tasks:  # another built-in task than the configured one: its defaults
            self._tasks[task_name] = get_task(task_name, configured if task_name == configured.name else None)
        return [self._tasks[task_name].score(c, reference) for c in completions]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def check_sandboxes(task: object, sandbox_pool: PoolClientSettings | None) -> None:
    """ConfigError at start for a task that runs programs (a code verifier, a mixture's included) with no
    sandbox pool and no sandbox backend that passes its self-test on this machine: without one every such
    task would be scored 0 after the engine had sampled it. With a pool nothing is checked here (the pool
    self-tests its own sandbox, and may start after the generators)."""
    for section in sandbox_sections(with_pool(task, sandbox_pool)):
        if section.pool is not None:
            continue
        try:
            sandbox_for(section)
        except SandboxUnavailable as exc:
            raise ConfigError(
                f"the task runs programs, but this generator has no sandbox pool (sandbox_pool) and {exc}"
            ) from exc
