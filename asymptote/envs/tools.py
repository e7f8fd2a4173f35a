"""Tool calls in the Hermes format, and plain Python classes as tool-using environments (torch-free).

Owns two things. Parsing a model's turn: Qwen2.5 and Qwen3 chat templates
(and vLLM's ``hermes`` tool parser) write each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
:func:`parse_turn` splits a turn into its text and its calls, reporting
each malformed call instead of guessing. And :class:`ToolClassEnvironment`,
which makes an environment of a plain class whose public methods are its
tools: their JSON schemas come from signatures, type hints and
docstrings (Google, NumPy or reST style, read by ``docstring_parser``), in
the form ``apply_chat_template(tools=...)`` takes, and their arguments are
validated by pydantic, which also writes their schema, before a call. Runs in an environment worker, never
in the generator's process (see ``asymptote.envs.pool``).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import docstring_parser
from pydantic import TypeAdapter, ValidationError, validate_call

from asymptote.envs.base import EnvTask, Message

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
UNCLOSED = "<tool_call>"
REWARD_METHOD = "reward"
"""The one public method of a tool class that is not a tool: ``reward(self, answer: str) -> float``."""
TOOL_ERROR = "Error: "
"""How a tool message that reports a failed call begins (the tool raised, or the call could not be made)."""
MAX_ERROR_CHARS = 500
"""A tool's error as the model sees it, cut to this length (a traceback is not an observation)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn split into its text and its tool calls."""

    content: str
    """The turn's text outside the tool calls (all of it, as it is, when it has none)."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One line per malformed call (bad JSON, no name, arguments that are not an object, unclosed tag)."""

    def message(self) -> Message:
        """The turn as an assistant message, with its calls as the chat template renders them."""
        out: Message = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls
            ]
        return out


def parse_turn(text: str) -> ParsedTurn:
    """Split ``text`` into its text and its ``<tool_call>`` calls, in order."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in TOOL_CALL.finditer(text):
        call, error = _parse_call(match.group(1))
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    rest = TOOL_CALL.sub("", text)
    if UNCLOSED in rest:
        # A call the turn never closed (it ran out of tokens mid-call): not executed.
        errors.append("a <tool_call> was not closed with </tool_call>")
        rest = rest[: rest.index(UNCLOSED)]
    if not calls and not errors:
        return ParsedTurn(text)  # as it is: a chat template renders it verbatim
    # The white space between the text and the calls is the format's (templates write their own).
    return ParsedTurn(rest.rstrip(), calls, errors)


def _parse_call(body: str) -> tuple[ToolCall | None, str]:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"a tool call is not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None, 'a tool call must be a JSON object with a "name" string'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        # Some models write the arguments as a JSON string of an object.
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return None, f'the "arguments" of tool call {value["name"]!r} must be a JSON object'
    return ToolCall(value["name"], arguments), ""


def tool_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """The tools of ``cls``: its public methods (functions defined on it or its bases), by name, in order."""
    tools: dict[str, Callable[..., Any]] = {}
    for name, member in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_") and name != REWARD_METHOD:
            tools[name] = member
    return tools


def tool_schemas(cls: type) -> list[dict[str, Any]]:
    """The JSON schema of every tool of ``cls`` (``{"type": "function", "function": {...}}`` each).

    ValueError naming the method when it has no docstring, or a parameter
    lacks a type hint or a line in the docstring (the model would see a tool
    it cannot call well).
    """
    tools = tool_methods(cls)
    if not tools:
        raise ValueError(f"{cls.__qualname__} has no public methods: a tool class needs at least one tool")
    return [_schema(f"{cls.__qualname__}.{name}", name, method) for name, method in tools.items()]


def _schema(where: str, name: str, method: Callable[..., Any]) -> dict[str, Any]:
    doc = docstring_parser.parse(inspect.getdoc(method) or "")
    description = "\n\n".join(d for d in (doc.short_description, doc.long_description) if d)
    if not description:
        raise ValueError(f"tool {where} has no docstring; it is the model's only account of what the tool does")
    described = {p.arg_name: p.description for p in doc.params if p.description}
    params = list(inspect.signature(method).parameters.values())[1:]  # after self
    for p in params:
        if p.annotation is p.empty:
            raise ValueError(f"tool {where}: parameter {p.name!r} has no type hint")
        if p.name not in described:
            raise ValueError(f"tool {where}: parameter {p.name!r} is not described in the docstring's Args")
    # The same pydantic core that validates a call's arguments (validate_call) writes their schema;
    # a TypeAdapter of a function is its arguments (pydantic's stubs list types only).
    parameters = _untitled(TypeAdapter(method).json_schema())  # type: ignore[arg-type]
    parameters["properties"].pop("self", None)
    parameters["required"] = [r for r in parameters.get("required", []) if r != "self"]
    for p in params:
        parameters["properties"][p.name]["description"] = described[p.name]
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _untitled(schema: Any) -> Any:
    """``schema`` without pydantic's ``title`` keywords (a property named "title" stays)."""
    if isinstance(schema, dict):
        return {k: _untitled(v) for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_untitled(v) for v in schema]
    return schema


class ToolClassEnvironment:
    """An environment made of a plain class whose public methods are its tools.

    Each episode gets a new instance, built as ``cls(task)`` when the
    constructor takes an argument and ``cls()`` otherwise. The first message
    is the task's prompt as the user's. Each model turn with tool calls is
    answered with one ``tool`` message per call, in order: the method's
    return value (text as it is, anything else as JSON), or the error the
    call raised, or why the call could not be made (unknown tool, invalid
    arguments, malformed call), so the model can correct itself. A turn
    without tool calls is the answer: the episode is done, with the reward
    from the class's ``reward(answer)`` if it has one, else None (the task's
    verifier scores it).
    """

    def __init__(self, cls: type, schemas: list[dict[str, Any]] | None = None) -> None:
        self.cls = cls
        self.schemas = tool_schemas(cls) if schemas is None else schemas
        """The tools' JSON schemas (``schemas``, when the caller built them once for many episodes)."""
        self.takes_task = _takes_argument(cls)
        self.instance: Any = None
        self.tools: dict[str, Callable[..., Any]] = {}

    async def reset(self, task: EnvTask) -> tuple[list[Message], list[dict[str, Any]]]:
        self.instance = self.cls(task) if self.takes_task else self.cls()
        self.tools = {name: validate_call(getattr(self.instance, name)) for name in tool_methods(self.cls)}
        return [{"role": "user", "content": task.prompt}], self.schemas

    async def step(self, assistant_turn: str) -> tuple[list[Message], float | None, bool]:
        turn = parse_turn(assistant_turn)
        if not turn.calls and not turn.errors:
            return [], await self._reward(assistant_turn), True
        observation: list[Message] = []
        for call in turn.calls:
            observation.append({"role": "tool", "name": call.name, "content": await self._call(call)})
        for error in turn.errors:
            observation.append({"role": "tool", "name": "error", "content": f"{TOOL_ERROR}{error}"})
        return observation, None, False

    async def _call(self, call: ToolCall) -> str:
        tool = self.tools.get(call.name)
        if tool is None:
            return f"{TOOL_ERROR}no tool named {call.name!r}; the tools are {', '.join(self.tools)}"
        try:
            result = tool(**call.arguments)
            if inspect.isawaitable(result):
                result = await result
        except ValidationError as exc:
            return _cut(f"{TOOL_ERROR}invalid arguments for {call.name}: {exc}")
        except Exception as exc:  # the tool's own error goes back to the model, which may try again
            return _cut(f"{TOOL_ERROR}{type(exc).__name__}: {exc}")
        return result if isinstance(result, str) else json.dumps(result, default=str)

    async def _reward(self, answer: str) -> float | None:
        hook = getattr(self.instance, REWARD_METHOD, None)
        if hook is None:
            return None
        value = hook(answer)
        if inspect.isawaitable(value):
            value = await value
        return None if value is None else float(value)


def _takes_argument(cls: type) -> bool:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
