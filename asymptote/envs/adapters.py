"""Environments written for other libraries, run as Asymptote environments (torch-free).

Owns the adapters from the environment libraries users bring to the
``reset``/``step`` interface (asymptote.envs.base):

- **OpenEnv** (``kind: openenv``): an OpenEnv environment, either its
  client (an ``openenv.core.EnvClient`` subclass, the way OpenEnv ships
  environments) talking to a server at ``base_url``, or its server-side
  ``Environment`` class run in the worker itself. The model's turn (after
  its reasoning) fills one text field of the environment's ``Action``;
  each observation is shown to the model as a user message; the reward
  that comes with ``done`` is the episode's.

The libraries are imported here only, in environment workers, which may
run on an interpreter of their own (``EnvironmentSettings.python``): the
generator never imports them.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from pydantic import BaseModel

from asymptote.envs.base import EnvTask, Message
from asymptote.envs.config import OpenEnvSettings, import_entry

OBSERVATION_BOOKKEEPING = frozenset({"done", "reward", "metadata"})
"""An OpenEnv observation's fields that are not for the model."""
THINK_CLOSE = "</think>"


def load_openenv(entry_cls: type, settings: OpenEnvSettings) -> type[BaseModel]:
    """The Action class; ValueError naming what does not fit (the entry's kind, the action field)."""
    from openenv.core import EnvClient
    from openenv.core.env_server import Environment as OpenEnvEnvironment

    expected = EnvClient if settings.base_url is not None else OpenEnvEnvironment
    if not issubclass(entry_cls, expected):
        with_url = "with" if settings.base_url is not None else "without"
        raise ValueError(f"is not an OpenEnv {expected.__name__} subclass, as openenv {with_url} base_url takes")
    action_cls = import_entry(settings.action)
    if not (isinstance(action_cls, type) and issubclass(action_cls, BaseModel)):
        raise ValueError(f"openenv action {settings.action!r} is not an OpenEnv Action class")
    if settings.action_field not in action_cls.model_fields:
        raise ValueError(
            f"openenv action_field {settings.action_field!r} is not a field of {action_cls.__name__} "
            f"(its fields: {', '.join(action_cls.model_fields)})"
        )
    return action_cls


class OpenEnvAdapter:
    """One episode of an OpenEnv environment (see the module docstring).

    ``reset`` passes the task as keyword arguments (``prompt``, ``reference``,
    ``task_id``), as far as the environment's ``reset`` takes them (the
    OpenEnv server filters them the same way); the first message is the
    task's prompt as the user's, followed by the reset observation when it
    has anything to say.
    """

    def __init__(self, entry_cls: type, action_cls: type[BaseModel], settings: OpenEnvSettings) -> None:
        self.entry_cls = entry_cls
        self.action_cls = action_cls
        self.settings = settings
        self.target: Any = None

    async def reset(self, task: EnvTask) -> tuple[list[Message], list[dict[str, Any]]]:
        given = {"prompt": task.prompt, "reference": task.reference, "task_id": task.task_id}
        if self.settings.base_url is not None:
            self.target = self.entry_cls(base_url=self.settings.base_url)
            await self.target.connect()
            first = (await self.target.reset(**given)).observation
        else:
            self.target = self.entry_cls()
            first = await self.target.reset_async(**_accepted(self.target.reset, given))
        shown = self._shown(first)
        return [{"role": "user", "content": f"{task.prompt}\n\n{shown}" if shown else task.prompt}], []

    async def step(self, assistant_turn: str) -> tuple[list[Message], float | None, bool]:
        answer = assistant_turn.rsplit(THINK_CLOSE, 1)[-1].strip()
        action = self.action_cls(**{self.settings.action_field: answer})
        if self.settings.base_url is not None:
            result = await self.target.step(action)
            observation, reward, done = result.observation, result.reward, bool(result.done)
        else:
            observation = await self.target.step_async(action)
            reward, done = observation.reward, bool(observation.done)
        if done:
            return [], None if reward is None else float(reward), True
        return [{"role": "user", "content": self._shown(observation)}], None, False

    async def close(self) -> None:
        target, self.target = self.target, None
        if target is None:
            return
        closed = target.close()
        if inspect.isawaitable(closed):
            await closed

    def _shown(self, observation: BaseModel) -> str:
        """An observation as the model reads it (see OpenEnvSettings.observation_field)."""
        if self.settings.observation_field is not None:
            value = getattr(observation, self.settings.observation_field)
            return value if isinstance(value, str) else json.dumps(value, default=str)
        fields = observation.model_dump(mode="json", exclude=set(OBSERVATION_BOOKKEEPING))
        if len(fields) == 1:
            (value,) = fields.values()
            return value if isinstance(value, str) else json.dumps(value)
        return json.dumps(fields)


def _accepted(function: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``given`` that ``function`` takes (all of them when it takes ``**kwargs``)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return given
    names = {p.name for p in parameters}
    return {k: v for k, v in given.items() if k in names}
