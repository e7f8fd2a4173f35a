"""Settings of a multi-turn environment and the limits every episode runs under (torch-free)."""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import Field, model_validator

from asymptote.config import Frozen

ENTRY_PATTERN = r"^[\w.]+:[\w.]+$"
"""A class (or any attribute) as ``package.module:Name``."""


def import_entry(entry: str) -> Any:
    """What ``package.module:Name`` (``Name`` may be dotted) names; ImportError or AttributeError if nothing."""
    module_name, _, attr = entry.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class OpenEnvSettings(Frozen):
    """How an OpenEnv environment's actions and observations become the model's turns and messages."""

    action: str | None = Field(default=None, pattern=ENTRY_PATTERN)
    """The environment's ``Action`` class as ``package.module:ClassName`` (not with ``mcp``)."""
    action_field: str | None = None
    """The ``Action`` field that takes the model's turn (its text after any reasoning), e.g. ``message``."""
    mcp: bool = False
    """An MCP environment (OpenEnv's ``MCPEnvironment``, or its ``MCPToolClient`` with ``base_url``): its
    tools, listed at reset, are offered to the model, each of the model's tool calls is a ``CallToolAction``
    answered by a tool message, and a turn without tool calls is the answer."""
    base_url: str | None = None
    """The environment's server (``http://`` or ``ws://``): the entry is then its client, an
    ``openenv.core.EnvClient`` subclass. None: the entry is the server-side ``Environment`` class, run in the
    worker."""
    observation_field: str | None = None
    """The observation field shown to the model; None: every field but done, reward and metadata, as JSON
    (a single one as its text)."""

    @model_validator(mode="after")
    def _check_action(self) -> OpenEnvSettings:
        if self.mcp and (self.action is not None or self.action_field is not None):
            raise ValueError("openenv mcp takes no action or action_field: the model's tool calls are the actions")
        if not self.mcp and (self.action is None or self.action_field is None):
            raise ValueError("openenv takes action and action_field (the Action class and its text field), or mcp")
        return self


class VerifiersSettings(Frozen):
    """How a verifiers environment is made."""

    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of its ``load_environment`` (or its class), as ``vf-eval``'s ``--env-args`` takes."""


class EnvironmentSettings(Frozen):
    """Which environment a generator runs episodes against, and each episode's limits."""

    entry: str = Field(pattern=ENTRY_PATTERN)
    """The environment's class as ``package.module:ClassName`` (kind verifiers: also its ``load_environment``
    function), imported in each environment worker."""
    kind: Literal["environment", "tools", "openenv", "verifiers"] = "environment"
    """environment: the class implements ``reset``/``step`` (asymptote.envs.base.Environment);
    tools: a plain class whose public methods are the model's tools (asymptote.envs.tools);
    openenv: an OpenEnv client or environment class, as ``openenv`` says; verifiers: a verifiers environment's
    ``load_environment`` function or class (both: asymptote.envs.adapters)."""
    openenv: OpenEnvSettings | None = None
    """With kind openenv: its action, observation and server."""
    verifiers: VerifiersSettings | None = None
    """With kind verifiers: how the environment is made (None: with no arguments)."""
    max_turns: int = Field(default=8, ge=1)
    """Model turns in one episode; the episode ends (``max_turns``) after the last."""
    max_episode_tokens: int = Field(default=4096, ge=1)
    """Tokens after the first prompt (the model's and the environment's); the episode ends (``max_tokens``)
    when a turn would have no room. Prompt plus this must fit the model's context."""
    max_turn_tokens: int = Field(default=1024, ge=1)
    """Tokens the model may sample in one turn."""
    cut_turn: Literal["end", "continue"] = "end"
    """A turn cut at its token limit before the model ended it: end the episode there (reason ``truncated``,
    or ``max_tokens`` when the episode's limit cut it; the verifier judges that turn, as a truncated
    completion is judged), or continue (the turn is closed as the template closes a turn, and the environment
    answers what it holds). Ending gives RL a reason to end turns: when a cut turn goes on, a policy can learn
    to run every turn to its limit after a tool call at no cost."""
    tool_timeout_s: float = Field(default=10.0, gt=0)
    """Time one ``reset`` or ``step`` (all of a turn's tool calls) may take; past it the worker is killed."""
    max_observation_bytes: int = Field(default=65536, ge=1)
    """Largest observation (or first messages and tools), as JSON; a larger one ends the episode."""
    num_workers: int = Field(default=4, ge=1)
    """Worker processes at most; more episodes than they host wait for one."""
    episodes_per_worker: int = Field(default=1, ge=1)
    """Episodes one worker hosts at once, each with its own environment on the worker's event loop: more
    than one saves a process (and its imports) per episode for environments that await rather than block,
    but a call past ``tool_timeout_s`` kills its worker and ends every episode on it (``env_crashed``)."""
    python: str | None = None
    """The interpreter the workers run, e.g. ``.venv-envs/bin/python``: a virtual environment holding the
    environment's own packages (``verifiers``, ``openenv``, ...), which need not fit the generator's. It needs
    pydantic and docstring-parser; this project's modules come from the generator's source tree. None: the
    generator's own interpreter."""

    @model_validator(mode="after")
    def _check_kind(self) -> EnvironmentSettings:
        if (self.kind == "openenv") != (self.openenv is not None):
            raise ValueError(
                "kind openenv takes the openenv settings (action and action_field, or mcp), and only it does"
            )
        if self.verifiers is not None and self.kind != "verifiers":
            raise ValueError("the verifiers settings go with kind verifiers only")
        return self
