"""Environments in worker processes: one episode per worker at a time, every call with a time limit.

Owns the ``EnvironmentPool``: spawned processes that import the configured
environment once and then host one episode each at a time (a worker is
leased for a whole episode, since an environment keeps state between its
turns, and reused by later episodes). Each ``reset``/``step`` runs in the
worker under ``tool_timeout_s``; what it returns is validated there
(``asymptote.envs.base``) and its size checked against
``max_observation_bytes`` before it is sent. Any failure ends the episode
with an :class:`EnvFailure` whose reason is counted by the caller:

- ``timeout``: the call ran past its limit (the worker is killed);
- ``raised``: the environment raised;
- ``invalid``: it returned something the interface does not allow;
- ``oversize``: its observation is larger than the limit;
- ``crashed``: the worker died (exit, signal, out of memory).

A worker that timed out or died is replaced by a new one for a later
episode; the generator's process never runs environment code, so nothing
an environment does takes it down. Requests and replies cross a socket as
JSON with a hard size bound. Workers are new interpreters
(``python -m asymptote.envs.worker``), not forks: the generator's process
holds vLLM's threads, which a fork would copy mid-flight. The interpreter
is the generator's own or ``settings.python``, a virtual environment that
holds the environment's own packages; either way the worker imports this
project's modules from the generator's source tree, and exits when the
generator is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

from asymptote.envs.adapters import OpenEnvAdapter, load_openenv, verifiers_factory
from asymptote.envs.base import Environment, EnvTask, InvalidOutput, Message, StepResult, check_reset, check_step
from asymptote.envs.config import EnvironmentSettings, import_entry
from asymptote.envs.tools import ToolClassEnvironment, tool_schemas
from asymptote.errors import ConfigError

log = logging.getLogger(__name__)

FailureReason = Literal["timeout", "raised", "invalid", "oversize", "crashed"]
FAILURE_REASONS: tuple[FailureReason, ...] = ("timeout", "raised", "invalid", "oversize", "crashed")

START_TIMEOUT_S = 120.0
"""A worker's start (interpreter, imports, the environment's module): not the environment's time."""
MAX_ERROR_CHARS = 2000
"""An environment's error, cut to this length in the reply (and in the episode's record)."""
REPLY_OVERHEAD_BYTES = 4 * MAX_ERROR_CHARS
"""A reply's bytes beyond its observation (keys, reward, an error): the pipe refuses anything larger."""


class EnvFailure(RuntimeError):
    """An environment call failed; ``reason`` is one of FAILURE_REASONS."""

    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(f"environment {reason}: {detail}")
        self.reason = reason
        self.detail = detail


# ---- the worker's side ----------------------------------------------------


def load_factory(settings: EnvironmentSettings) -> Callable[[], Environment]:
    """A new environment per call, for ``settings.entry``; ConfigError naming the entry when it cannot be."""
    try:
        obj: Any = import_entry(settings.entry)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"environment entry {settings.entry!r} cannot be imported: {exc}") from exc
    if settings.kind == "verifiers":
        env_args = settings.verifiers.env_args if settings.verifiers is not None else {}
        try:
            return verifiers_factory(obj, env_args)
        except Exception as exc:  # the environment's own construction, whatever it raises
            raise ConfigError(f"environment entry {settings.entry!r}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, type):
        raise ConfigError(f"environment entry {settings.entry!r} is a {type(obj).__name__}, not a class")
    if settings.openenv is not None:
        openenv = settings.openenv
        try:
            action_cls = load_openenv(obj, openenv)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"environment entry {settings.entry!r}: {exc}") from exc
        entry_cls = obj
        return lambda: OpenEnvAdapter(entry_cls, action_cls, openenv)
    if settings.kind == "tools":
        try:
            schemas = tool_schemas(obj)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"environment entry {settings.entry!r}: {exc}") from exc
        cls = obj
        return lambda: ToolClassEnvironment(cls, schemas)
    missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(
            f"environment entry {settings.entry!r} lacks {' and '.join(missing)}; "
            "a plain class of tools takes kind 'tools'"
        )
    return obj


class _Host:
    """The worker's episode: one environment at a time, on one event loop kept for the worker's life."""

    def __init__(self, settings: EnvironmentSettings, factory: Callable[[], Environment]) -> None:
        self.settings = settings
        self.factory = factory
        self.loop = asyncio.new_event_loop()
        self.env: Environment | None = None

    def handle(self, request: dict[str, Any]) -> bytes:
        try:
            body = self._run(request)
            encoded = json.dumps({"ok": True, **body}).encode()
        except _Oversize as exc:
            return _error("oversize", str(exc))
        except InvalidOutput as exc:
            return _error("invalid", str(exc))
        except (Exception, SystemExit) as exc:  # the environment's own failure: reported, the worker goes on
            return _error("raised", f"{type(exc).__name__}: {exc}")
        if len(encoded) > self.settings.max_observation_bytes + REPLY_OVERHEAD_BYTES:
            return _error("oversize", f"{len(encoded)} bytes, over max_observation_bytes")
        return encoded

    def _run(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "reset":
            self.env = self.factory()
            task = EnvTask.model_validate(request["task"])
            messages, tools = check_reset(self.loop.run_until_complete(self.env.reset(task)))
            self._check_size({"messages": messages, "tools": tools})
            return {"messages": messages, "tools": tools}
        if op == "step":
            if self.env is None:
                raise RuntimeError("step before reset")
            result = check_step(self.loop.run_until_complete(self.env.step(request["turn"])))
            self._check_size(result.observation)
            return {"observation": result.observation, "reward": result.reward, "done": result.done}
        if op == "close":
            env, self.env = self.env, None
            close = getattr(env, "close", None)
            if callable(close):
                value = close()
                if asyncio.iscoroutine(value):
                    self.loop.run_until_complete(value)
            return {}
        raise ValueError(f"unknown request {op!r}")

    def _check_size(self, value: object) -> None:
        try:
            size = len(json.dumps(value).encode())
        except (TypeError, ValueError) as exc:  # tools with values JSON cannot hold
            raise InvalidOutput(f"the environment's output is not JSON: {exc}") from None
        if size > self.settings.max_observation_bytes:
            raise _Oversize(f"{size} bytes; max_observation_bytes is {self.settings.max_observation_bytes}")


class _Oversize(Exception):
    pass


def _error(kind: FailureReason, detail: str) -> bytes:
    return json.dumps({"ok": False, "kind": kind, "error": detail[:MAX_ERROR_CHARS]}).encode()


PARENT_POLL_S = 1.0
"""How often a worker checks that the generator that started it is alive."""


def _exit_with_parent() -> None:
    """End this worker once its parent is gone (a generator killed by SIGKILL leaves no one to close the
    socket while an environment is busy in a step)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)  # polling: no portable event for a parent's exit
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve(conn: Connection, settings_json: str) -> None:
    """A worker's main: import the environment, say ready, then answer requests until the socket closes."""
    _exit_with_parent()
    settings = EnvironmentSettings.model_validate_json(settings_json)
    try:
        factory = load_factory(settings)
    except Exception as exc:
        conn.send_bytes(_error("raised", str(exc)))
        return
    conn.send_bytes(json.dumps({"ok": True}).encode())
    host = _Host(settings, factory)
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        conn.send_bytes(host.handle(request))


# ---- the generator's side -------------------------------------------------


SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The folder holding this project's packages: on every worker's path, whatever its interpreter."""


def worker_path() -> str:
    """A worker's PYTHONPATH: this project's source tree and the generator's own path entries outside its
    interpreter's installation (where an environment's module may live, e.g. the working directory), so
    that a worker in another virtual environment takes its packages from there and nothing else."""
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    entries = [str(SOURCE_ROOT)]
    for entry in sys.path:
        path = Path(entry or os.getcwd()).resolve()
        if any(path == root or root in path.parents for root in installed) or str(path) in entries:
            continue
        entries.append(str(path))
    return os.pathsep.join(entries)


class _Worker:
    def __init__(self, settings: EnvironmentSettings) -> None:
        python = settings.python or sys.executable
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        child_fd = theirs.detach()
        try:
            self.process = subprocess.Popen(
                [python, "-m", "asymptote.envs.worker", str(child_fd), settings.model_dump_json()],
                pass_fds=(child_fd,),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": worker_path()},
            )
        except OSError as exc:
            self.conn.close()
            raise ConfigError(f"environment python {python!r} cannot be started: {exc}") from exc
        finally:
            os.close(child_fd)
        self.max_reply_bytes = settings.max_observation_bytes + REPLY_OVERHEAD_BYTES
        self.broken = False

    async def started(self) -> None:
        reply = await self._receive(START_TIMEOUT_S)
        if not reply["ok"]:
            raise ConfigError(str(reply["error"]))

    async def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The worker's reply to ``request``; EnvFailure (and the worker marked broken) when it fails."""
        try:
            self.conn.send_bytes(json.dumps(request).encode())
        except OSError as exc:
            self.broken = True
            raise EnvFailure("crashed", f"the worker is gone ({exc})") from None
        try:
            reply = await self._receive(timeout_s)
        except asyncio.CancelledError:
            self.kill()  # its reply would be taken for the next request's
            raise
        if not reply["ok"]:
            raise EnvFailure(reply["kind"], str(reply["error"]))
        return reply

    async def _receive(self, timeout_s: float) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        received: asyncio.Future[bytes] = loop.create_future()
        fd = self.conn.fileno()

        def readable() -> None:
            loop.remove_reader(fd)
            if received.done():
                return
            try:
                # Bounded: a worker cannot make this process read an unbounded message.
                received.set_result(self.conn.recv_bytes(self.max_reply_bytes))
            except (EOFError, OSError) as exc:
                received.set_exception(exc)

        loop.add_reader(fd, readable)
        try:
            try:
                data = await asyncio.wait_for(received, timeout_s)
            finally:
                loop.remove_reader(fd)
        except TimeoutError:
            self.kill()
            raise EnvFailure("timeout", f"no answer within {timeout_s:g}s; the worker was killed") from None
        except EOFError:
            self.kill()
            raise EnvFailure("crashed", f"the worker died (exit code {self._exitcode()})") from None
        except OSError as exc:  # longer than the bound: the reply is not read, the pipe is unusable
            self.kill()
            raise EnvFailure("oversize", f"the worker's reply exceeds {self.max_reply_bytes} bytes ({exc})") from None
        reply: dict[str, Any] = json.loads(data)
        return reply

    def _exitcode(self) -> int | None:
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.broken = True
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5.0)
        self.conn.close()


class EnvSession:
    """One episode's environment, in the worker leased for it."""

    def __init__(self, worker: _Worker, settings: EnvironmentSettings) -> None:
        self._worker = worker
        self.settings = settings

    async def reset(self, task: EnvTask) -> tuple[list[Message], list[dict[str, Any]]]:
        reply = await self._worker.call({"op": "reset", "task": task.model_dump()}, self.settings.tool_timeout_s)
        return reply["messages"], reply["tools"]

    async def step(self, assistant_turn: str) -> StepResult:
        reply = await self._worker.call({"op": "step", "turn": assistant_turn}, self.settings.tool_timeout_s)
        return StepResult(observation=reply["observation"], reward=reply["reward"], done=reply["done"])


class EnvironmentPool:
    """Leases a worker per episode (see the module docstring); at most ``num_workers`` episodes at once."""

    def __init__(self, settings: EnvironmentSettings) -> None:
        self.settings = settings
        self._idle: list[_Worker] = []
        self._leased: set[_Worker] = set()
        self._slots = asyncio.Semaphore(settings.num_workers)
        self.num_started = 0
        """Workers started so far (replacements of killed ones included)."""

    async def start(self) -> None:
        """Start one worker, so that an environment that cannot load fails here (ConfigError), once."""
        self._idle.append(await self._spawn())

    async def _spawn(self) -> _Worker:
        worker = _Worker(self.settings)
        self.num_started += 1
        try:
            await worker.started()
        except BaseException:
            worker.kill()
            raise
        return worker

    @contextlib.asynccontextmanager
    async def episode(self) -> AsyncIterator[EnvSession]:
        """A worker for one episode, given back (its environment closed) or replaced after it."""
        async with self._slots:
            worker = self._idle.pop() if self._idle else None
            if worker is None:
                try:
                    worker = await self._spawn()
                except ConfigError as exc:  # it loaded in the first worker: this one is broken
                    raise EnvFailure("crashed", f"a new worker did not start: {exc}") from exc
            self._leased.add(worker)
            try:
                yield EnvSession(worker, self.settings)
            finally:
                self._leased.discard(worker)
                await self._give_back(worker)

    async def _give_back(self, worker: _Worker) -> None:
        if not worker.broken:
            try:
                await worker.call({"op": "close"}, self.settings.tool_timeout_s)
            except EnvFailure as exc:
                log.warning("closing an environment failed, its worker is replaced: %s", exc)
                worker.kill()
        if worker.broken:
            worker.kill()
        else:
            self._idle.append(worker)

    def close(self) -> None:
        """Stop every worker (a stuck one is killed)."""
        for worker in self._idle + list(self._leased):
            worker.kill()
        self._idle.clear()
        self._leased.clear()
