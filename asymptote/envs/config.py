"""Settings of a multi-turn environment and the limits every episode runs under (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asymptote.config import Frozen


class EnvironmentSettings(Frozen):
    """Which environment a generator runs episodes against, and each episode's limits."""

    entry: str = Field(pattern=r"^[\w.]+:[\w.]+$")
    """The environment's class as ``package.module:ClassName``, imported in each environment worker."""
    kind: Literal["environment", "tools"] = "environment"
    """environment: the class implements ``reset``/``step`` (asymptote.envs.base.Environment);
    tools: a plain class whose public methods are the model's tools (asymptote.envs.tools)."""
    max_turns: int = Field(default=8, ge=1)
    """Model turns in one episode; the episode ends (``max_turns``) after the last."""
    max_episode_tokens: int = Field(default=4096, ge=1)
    """Tokens after the first prompt (the model's and the environment's); the episode ends (``max_tokens``)
    when a turn would have no room. Prompt plus this must fit the model's context."""
    max_turn_tokens: int = Field(default=1024, ge=1)
    """Tokens the model may sample in one turn (a turn cut here is closed as the template closes a turn)."""
    tool_timeout_s: float = Field(default=10.0, gt=0)
    """Time one ``reset`` or ``step`` (all of a turn's tool calls) may take; past it the worker is killed."""
    max_observation_bytes: int = Field(default=65536, ge=1)
    """Largest observation (or first messages and tools), as JSON; a larger one ends the episode."""
    num_workers: int = Field(default=4, ge=1)
    """Worker processes, one per episode in flight: more episodes wait for a worker."""
