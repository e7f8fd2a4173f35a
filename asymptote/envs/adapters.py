"""Environments written for other libraries, run as Asymptote environments (torch-free).

Owns the adapters from the environment libraries users bring to the
``reset``/``step`` interface (asymptote.envs.base):

- **OpenEnv** (``kind: openenv``): an OpenEnv environment, either its
  client (an ``openenv.core.EnvClient`` subclass, the way OpenEnv ships
  environments) talking to a server at ``base_url``, or its server-side
  ``Environment`` class run in the worker itself. The model's turn (after
  its reasoning) fills one text field of the environment's ``Action``;
  each observation is shown to the model as a user message; the reward
  that comes with ``done`` is the episode's. An MCP environment
  (``mcp: true``: OpenEnv's ``MCPEnvironment``, or its ``MCPToolClient``)
  offers its tools instead: they are listed at reset (``ListToolsAction``)
  and given to the chat template, each of the model's Hermes tool calls is
  a ``CallToolAction`` whose result (or error) is a tool message, and a
  turn without calls is the answer.

- **verifiers** (``kind: verifiers``): a ``verifiers`` environment
  (``MultiTurnEnv``, ``ToolEnv`` and their kin; the version pinned in
  scripts/envs-requirements.txt), the entry being its ``load_environment``
  function or its class. The environment runs its own rollout
  (``run_rollout``: its turns, tools, stop conditions and rubric) with a
  client that hands each model request to the generator and the generator's
  turn back as the model's response: each request's new messages are an
  observation, the rubric's reward at the end is the episode's.

The libraries are imported here only, in environment workers, which may
run on an interpreter of their own (``EnvironmentSettings.python``): the
generator never imports them.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from asymptote.envs.base import EnvTask, Message
from asymptote.envs.config import OpenEnvSettings, import_entry
from asymptote.envs.tools import TOOL_ERROR, ParsedTurn, parse_turn

OBSERVATION_BOOKKEEPING = frozenset({"done", "reward", "metadata"})
"""An OpenEnv observation's fields that are not for the model."""
THINK_CLOSE = "</think>"


def load_openenv(entry_cls: type, settings: OpenEnvSettings) -> type[BaseModel] | None:
    """The Action class (None for an MCP environment, whose actions are OpenEnv's own); ValueError naming
    what does not fit (the entry's kind, the action field)."""
    from openenv.core import EnvClient
    from openenv.core.env_server import Environment as OpenEnvEnvironment

    expected = EnvClient if settings.base_url is not None else OpenEnvEnvironment
    if not issubclass(entry_cls, expected):
        with_url = "with" if settings.base_url is not None else "without"
        raise ValueError(f"is not an OpenEnv {expected.__name__} subclass, as openenv {with_url} base_url takes")
    if settings.mcp:
        return None
    assert settings.action is not None, "checked by OpenEnvSettings"
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
    ``task_id``), as far as the environment's ``reset`` takes them (its
    ``reset_async`` where it has its own; the OpenEnv server filters them the
    same way); the first message is the
    task's prompt as the user's, followed by the reset observation when it
    has anything to say.
    """

    def __init__(self, entry_cls: type, action_cls: type[BaseModel] | None, settings: OpenEnvSettings) -> None:
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
            first = await self.target.reset_async(**_accepted(_reset_taking(self.target), given))
        shown = self._shown(first)
        messages: list[Message] = [{"role": "user", "content": f"{task.prompt}\n\n{shown}" if shown else task.prompt}]
        return messages, await self._tools() if self.settings.mcp else []

    async def step(self, assistant_turn: str) -> tuple[list[Message], float | None, bool]:
        if self.settings.mcp:
            return await self._call_tools(parse_turn(assistant_turn))
        assert self.action_cls is not None and self.settings.action_field is not None, "checked by OpenEnvSettings"
        answer = assistant_turn.rsplit(THINK_CLOSE, 1)[-1].strip()
        observation, reward, done = await self._act(self.action_cls(**{self.settings.action_field: answer}))
        if done:
            return [], None if reward is None else float(reward), True
        return [{"role": "user", "content": self._shown(observation)}], None, False

    async def _act(self, action: BaseModel) -> tuple[Any, float | None, bool]:
        """(observation, reward, done) of one action, through the client or the environment itself."""
        if self.settings.base_url is not None:
            result = await self.target.step(action)
            return result.observation, result.reward, bool(result.done)
        observation = await self.target.step_async(action)
        return observation, observation.reward, bool(observation.done)

    async def _tools(self) -> list[dict[str, Any]]:
        """An MCP environment's tools as chat templates take them; RuntimeError when it cannot list them."""
        from openenv.core.env_server.mcp_types import ListToolsAction

        listed, _, _ = await self._act(ListToolsAction())
        error = (listed.metadata or {}).get("error")
        if error:
            raise RuntimeError(f"the MCP environment did not list its tools: {error}")
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in listed.tools
        ]

    async def _call_tools(self, turn: ParsedTurn) -> tuple[list[Message], float | None, bool]:
        """Each of the turn's calls as a CallToolAction, in order; a turn without calls is the answer."""
        from openenv.core.env_server.mcp_types import CallToolAction

        if not turn.calls and not turn.errors:
            return [], None, True
        observation: list[Message] = []
        for call in turn.calls:
            result, reward, done = await self._act(CallToolAction(tool_name=call.name, arguments=call.arguments))
            if done:  # the environment ended the episode with this call
                return [], None if reward is None else float(reward), True
            observation.append({"role": "tool", "name": call.name, "content": _tool_result(result)})
        for error in turn.errors:
            observation.append({"role": "tool", "name": "error", "content": f"{TOOL_ERROR}{error}"})
        return observation, None, False

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
        if not fields:
            return ""
        if len(fields) == 1:
            (value,) = fields.values()
            return value if isinstance(value, str) else json.dumps(value)
        return json.dumps(fields)


def _tool_result(observation: Any) -> str:
    """A CallToolObservation as the model reads it: the error's message, else the result's text content
    (an MCP result's ``content`` items), else the result as JSON."""
    if observation.error is not None:
        error = observation.error
        message = error.message if hasattr(error, "message") else error.get("message", error)
        return f"{TOOL_ERROR}{message}"
    result = observation.result
    content = getattr(result, "content", None)
    if content is None and isinstance(result, dict):
        content = result.get("content")
    if isinstance(content, list):
        texts = [getattr(c, "text", None) or (c.get("text") if isinstance(c, dict) else None) for c in content]
        if texts and all(isinstance(t, str) for t in texts):
            return "\n".join(t for t in texts if t is not None)
    return result if isinstance(result, str) else json.dumps(result, default=str)


def _reset_taking(target: Any) -> Any:
    """The method whose parameters say which keywords an in-process reset takes: the environment's own
    ``reset_async`` where it overrides OpenEnv's (which hands its keywords to ``reset``), else ``reset``."""
    defining = next(c for c in type(target).__mro__ if "reset_async" in vars(c))
    return target.reset if defining.__module__.startswith("openenv.") else target.reset_async


def _accepted(function: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``given`` that ``function`` takes (all of them when it takes ``**kwargs``)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return given
    names = {p.name for p in parameters}
    return {k: v for k, v in given.items() if k in names}


# ---- verifiers ----------------------------------------------------------------------


def load_verifiers(entry: Any, env_args: dict[str, Any]) -> Any:
    """The verifiers environment ``entry`` makes (its ``load_environment(**env_args)`` or its class called
    so); ValueError when it is neither or makes something other than a verifiers Environment."""
    import verifiers as vf

    if not callable(entry):
        raise ValueError(f"is a {type(entry).__name__}, not a load_environment function or an environment class")
    env = entry(**env_args)
    if not isinstance(env, vf.Environment):
        raise ValueError(f"made a {type(env).__name__}, not a verifiers Environment")
    return env


class VerifiersAdapter:
    """One episode of a verifiers environment (see the module docstring); ``env`` is shared by the worker's
    episodes, as verifiers shares one environment among its rollouts.

    The rollout's prompt is the environment's system prompt, if it has one,
    and the task's prompt as the user's; the task's reference is its
    ``answer``. A turn's ``<tool_call>`` calls become the response's tool
    calls (their results come back as tool messages named after them); its
    other text is the response's content. A rollout that ends with an error
    ends the episode with it (raised).
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self.rollout: asyncio.Future[Any] | None = None
        self.asked: asyncio.Future[tuple[list[Any], list[Any] | None]] | None = None
        self.reply: asyncio.Future[ParsedTurn] | None = None
        self.sent = 0
        """Messages of the rollout's conversation the model has seen (its own turns included)."""
        self.tool_names: dict[str, str] = {}

    async def reset(self, task: EnvTask) -> tuple[list[Message], list[dict[str, Any]]]:
        system = getattr(self.env, "system_prompt", None)
        prompt = [
            *([{"role": "system", "content": system}] if system else []),
            {"role": "user", "content": task.prompt},
        ]
        given = {"prompt": prompt, "example_id": 0, "answer": task.reference, "info": {"task_id": task.task_id}}
        client = _turn_client(self)
        self.rollout = asyncio.ensure_future(self.env.run_rollout(given, client, "policy", {}))
        asked = await self._next()
        if asked is None:
            raise RuntimeError("the verifiers rollout ended before asking the model for a turn")
        messages, tools = asked
        self.sent = len(messages)
        return [self._message(m) for m in messages], [_tool_schema(t) for t in tools or []]

    async def step(self, assistant_turn: str) -> tuple[list[Message], float | None, bool]:
        assert self.reply is not None, "step before reset"
        self.reply.set_result(parse_turn(assistant_turn))
        asked = await self._next()
        if asked is None:
            assert self.rollout is not None
            output = self.rollout.result()
            if output.get("error"):
                raise RuntimeError(f"the verifiers rollout failed: {output['error']}")
            reward = output.get("reward")
            return [], None if reward is None else float(reward), True
        messages, _ = asked
        new = messages[self.sent + 1 :]  # after the model's turn, as the environment recorded it
        self.sent = len(messages)
        return [self._message(m) for m in new], None, False

    async def close(self) -> None:
        if self.rollout is not None and not self.rollout.done():
            self.rollout.cancel()
            await asyncio.gather(self.rollout, return_exceptions=True)

    async def _next(self) -> tuple[list[Any], list[Any] | None] | None:
        """The rollout's next request to the model, or None when the rollout ended (its error raised)."""
        assert self.rollout is not None
        self.asked = asyncio.get_running_loop().create_future()
        await asyncio.wait({self.asked, self.rollout}, return_when=asyncio.FIRST_COMPLETED)
        if self.asked.done():
            return self.asked.result()
        self.rollout.result()  # the rollout's own exception, if it raised
        return None

    async def ask(self, prompt: list[Any], tools: list[Any] | None) -> ParsedTurn:
        """The client's side: hand the request over and wait for the generator's turn."""
        assert self.asked is not None and not self.asked.done(), "the rollout asked twice without an answer"
        self.reply = asyncio.get_running_loop().create_future()
        self.asked.set_result((prompt, tools))
        return await self.reply

    def _message(self, message: Any) -> Message:
        data = message.model_dump() if isinstance(message, BaseModel) else dict(message)
        content = data.get("content") or ""
        if isinstance(content, list):  # content parts: their text
            content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        role = data.get("role")
        if role == "tool":
            name = self.tool_names.get(str(data.get("tool_call_id")), "tool")
            return {"role": "tool", "name": name, "content": str(content)}
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"the verifiers environment sent a message with role {role!r}")
        return {"role": role, "content": str(content)}


def _tool_schema(tool: Any) -> dict[str, Any]:
    data = tool.model_dump() if isinstance(tool, BaseModel) else dict(tool)
    function = {k: data[k] for k in ("name", "description", "parameters") if k in data}
    return {"type": "function", "function": function}


def _turn_client(adapter: VerifiersAdapter) -> Any:
    """A verifiers Client whose model is the generator: each request goes to ``adapter.ask``."""
    import verifiers as vf
    from verifiers.clients import Client
    from verifiers.types import ResponseMessage, ToolCall

    class TurnClient(Client):  # type: ignore[misc]
        def setup_client(self, config: Any) -> Any:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict[str, Any]]:
            return messages, {}

        async def get_native_response(
            self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kwargs: Any
        ) -> ParsedTurn:
            return await adapter.ask(list(prompt), tools)

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: ParsedTurn) -> Any:
            calls = []
            for call in response.calls:
                call_id = f"call_{uuid.uuid4().hex[:12]}"
                adapter.tool_names[call_id] = call.name
                calls.append(ToolCall(id=call_id, name=call.name, arguments=json.dumps(call.arguments)))
            message = ResponseMessage(
                content=response.content,
                tool_calls=calls or None,
                finish_reason="tool_calls" if calls else "stop",
                is_truncated=False,
            )
            return vf.Response(id=uuid.uuid4().hex, created=int(time.time()), model="policy", message=message)

        async def close(self) -> None:
            return None

    return TurnClient(object())


def verifiers_factory(entry: Any, env_args: dict[str, Any]) -> Callable[[], VerifiersAdapter]:
    """An adapter per episode around one environment, built now (a worker's start: it fails there)."""
    env = load_verifiers(entry, env_args)
    return lambda: VerifiersAdapter(env)
