"""Multi-turn environments that generators run beside their engine (torch-free).

``base``: the interface (``reset``/``step``) and the validation of what an
environment returns; ``tools``: the Hermes tool-call format and plain
classes of tools as environments; ``pool``: environments in killable worker
processes with time and size limits; ``transcript``: the chat template's
difference, tokenised, after each turn; ``config``: the settings and limits.
"""

from __future__ import annotations

from asymptote.envs.base import Environment, EnvTask, InvalidOutput, Message, StepResult
from asymptote.envs.config import EnvironmentSettings
from asymptote.envs.pool import FAILURE_REASONS, EnvFailure, EnvironmentPool, EnvSession
from asymptote.envs.tools import ParsedTurn, ToolCall, ToolClassEnvironment, parse_turn, tool_schemas
from asymptote.envs.transcript import Extension, Transcript

__all__ = [
    "FAILURE_REASONS",
    "EnvFailure",
    "EnvSession",
    "EnvTask",
    "Environment",
    "EnvironmentPool",
    "EnvironmentSettings",
    "Extension",
    "InvalidOutput",
    "Message",
    "ParsedTurn",
    "StepResult",
    "ToolCall",
    "ToolClassEnvironment",
    "Transcript",
    "parse_turn",
    "tool_schemas",
]
