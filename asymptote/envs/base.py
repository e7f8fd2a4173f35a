"""The environment interface a generator runs multi-turn episodes against (torch-free).

Owns what an environment is to the rest of the system: ``reset(task)``
opens an episode with its first chat messages and the tools the model may
call; ``step(assistant_turn)`` takes the text of one model turn and answers
with the environment's next messages (the observation), a reward or None,
and whether the episode is over. Also the types that cross the boundary
(chat messages and tool schemas as plain dicts, the form chat templates
take) and their validation, since what an environment returns is never
trusted. Knows nothing about tokens, engines or worker processes (see
``asymptote.envs.pool`` and ``services.generator.episode``).
"""

from __future__ import annotations

import math
from typing import Any, Literal, NotRequired, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from typing_extensions import TypedDict


class Message(TypedDict):
    """One chat message, as ``apply_chat_template`` takes it."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: NotRequired[str]
    """A tool message's tool."""
    tool_calls: NotRequired[list[dict[str, Any]]]
    """An assistant message's calls, ``{"type": "function", "function": {"name", "arguments"}}`` each."""


class EnvTask(BaseModel):
    """What an episode is about: the task's prompt and whatever the environment needs to judge it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str = ""
    prompt: str
    reference: str = ""
    """The task's reference answer (the environment's to use; never shown to the model by the generator)."""


class StepResult(BaseModel):
    """An environment's answer to one model turn."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    observation: list[Message]
    """Messages to the model (tool results, a user's reply); empty when the episode is done."""
    reward: float | None = None
    """The episode's reward, given with ``done`` (None: the generator's verifier scores the final turn)."""
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """One episode's environment, created in a worker process for that episode."""

    async def reset(self, task: EnvTask) -> tuple[list[Message], list[dict[str, Any]]]:
        """The first messages and the tools' JSON schemas (``{"type": "function", "function": {...}}``)."""
        ...

    async def step(self, assistant_turn: str) -> tuple[list[Message], float | None, bool]:
        """(observation, reward or None, done) for the model's turn (its text, special tokens removed)."""
        ...


_messages = TypeAdapter(list[Message])
_tools = TypeAdapter(list[dict[str, Any]])


class InvalidOutput(ValueError):
    """An environment returned something that is not what the interface promises."""


def check_reset(value: object) -> tuple[list[Message], list[dict[str, Any]]]:
    """``reset``'s return value validated: (messages, tools); InvalidOutput naming what is wrong."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise InvalidOutput(f"reset must return (messages, tools), got {type(value).__name__}")
    try:
        messages = _messages.validate_python(value[0], strict=True)
        tools = _tools.validate_python(value[1], strict=True)
    except ValidationError as exc:
        raise InvalidOutput(f"reset returned invalid messages or tools: {_brief(exc)}") from None
    if not messages:
        raise InvalidOutput("reset returned no messages")
    return messages, tools


def check_step(value: object) -> StepResult:
    """``step``'s return value validated; InvalidOutput naming what is wrong."""
    if not isinstance(value, tuple) or len(value) != 3:
        raise InvalidOutput(f"step must return (observation, reward, done), got {type(value).__name__}")
    observation, reward, done = value
    try:
        messages = _messages.validate_python(observation, strict=True)
    except ValidationError as exc:
        raise InvalidOutput(f"step returned an invalid observation: {_brief(exc)}") from None
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise InvalidOutput(f"step returned reward {reward!r}; accepted: a number or None")
    if reward is not None and not math.isfinite(reward):
        raise InvalidOutput(f"step returned reward {reward!r}; a reward must be finite")
    if not isinstance(done, bool):
        raise InvalidOutput(f"step returned done={done!r}; accepted: True or False")
    if not done and not messages:
        raise InvalidOutput("step returned no observation for an episode that goes on")
    return StepResult(observation=messages, reward=None if reward is None else float(reward), done=done)


def _brief(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{exc.error_count()} error(s), first at {where or 'top level'}: {first['msg']}"
