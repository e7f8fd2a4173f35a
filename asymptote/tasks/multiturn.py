"""A multi-turn task: a dataset's problems, each played as episodes against an environment (torch-free).

Owns the ``multiturn`` task's settings: the dataset the problems come from
(its files, split, ids, prompt format, verifier and reward style, as a
``dataset`` task reads them) and the ``EnvironmentSettings`` of the
environment every episode runs against (asymptote/envs). The broker
issues a multi-turn task's problems as it issues a dataset task's, train
and eval alike, each with the task digest; a generator plays
``num_samples`` episodes of each (services/generator/episode.py).

An episode's reward is the environment's when it gives one at the end,
else the verifier's on the text of the model's final turn (also when the
environment failed mid-episode or the episode ran out of turns or
tokens). Prompts go
to the environment as the dataset's ``prompt_format`` makes them; the
environment writes the first messages (a system message included), which
the model's chat template renders, so the dataset's template must be
``chat`` and it has no system prompt of its own. An episode has its own
token limits (the broker's ``sampling.max_tokens`` does not apply, nor does
overlong shaping); the dataset's interruption length control, when on,
gives each episode one thinking budget spent across its turns, and caps
each turn's answer at the answer budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from asymptote.config import Frozen
from asymptote.envs.config import EnvironmentSettings
from asymptote.tasks.base import Problem, Split
from asymptote.tasks.dataset import DatasetSettings, DatasetTask

OPERATIONAL_ENVIRONMENT_FIELDS = frozenset({"num_workers", "episodes_per_worker", "python"})
"""Environment settings that say how a generator hosts episodes, not what an episode is: left out of the digest."""


class MultiTurnSettings(Frozen):
    """Problems from a dataset, each played as multi-turn episodes against an environment."""

    name: Literal["multiturn"] = "multiturn"
    """Task kind."""
    dataset: DatasetSettings
    """The problems, their ids and held-out split, the prompt format, and the verifier and reward style that
    score an episode's final turn when the environment gives no reward."""
    environment: EnvironmentSettings
    """The environment each episode runs against, and each episode's limits."""
    chat_template_kwargs: dict[str, bool | int | float | str] = Field(default_factory=dict)
    """Passed to every rendering of the chat template, e.g. enable_thinking: false for Qwen3 (whose template
    then re-renders earlier turns without their empty think blocks, so each turn starts a new sequence)."""

    @model_validator(mode="after")
    def _check(self) -> MultiTurnSettings:
        d = self.dataset
        if d.template != "chat":
            raise ValueError("a multi-turn task's dataset needs template 'chat' (episodes are chat conversations)")
        if d.system_prompt is not None:
            raise ValueError(
                "a multi-turn task's dataset takes no system_prompt: the environment writes the first messages"
            )
        return self


def episode_prompt(settings: MultiTurnSettings, prompt: str) -> str:
    """What the environment gets as a problem's prompt: the dataset's prompt format filled in."""
    return settings.dataset.prompt_format.format(prompt=prompt)


class MultiTurnTask:
    """The dataset's problems; an episode's final turn is scored by the dataset's verifier."""

    name: str = "multiturn"

    def __init__(self, settings: MultiTurnSettings) -> None:
        self.settings = settings
        self.dataset = DatasetTask(settings.dataset)

    def problems(self, split: Split) -> Sequence[Problem]:
        """The dataset's problems of ``split``."""
        return self.dataset.problems(split)

    def score(self, completion_text: str, reference: str) -> float:
        """The verifier's reward of a final turn (generators judge in their scoring pool, with a time limit)."""
        return self.dataset.score(completion_text, reference)
