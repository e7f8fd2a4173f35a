"""Environments in worker processes: episodes leased on workers, every call with a time limit.

Owns the ``EnvironmentPool``: spawned processes that import the configured
environment once and then host episodes, each with an environment of its
own (an episode is leased on a worker for its whole life, since an
environment keeps state between its turns; workers are reused by later
episodes). A worker hosts ``episodes_per_worker`` episodes at once (one by
default) on its event loop, requests and replies matched by id. Each
``reset``/``step`` runs in the worker under ``tool_timeout_s``; what it
returns is validated there (``asymptote.envs.base``) and its size checked
against ``max_observation_bytes`` before it is sent. Any failure ends the
episode with an :class:`EnvFailure` whose reason is counted by the caller:

- ``timeout``: the call ran past its limit (the worker is killed, and the
  other episodes it hosts end ``crashed``);
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
import itertools
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
    """The worker's episodes, each with its own environment, on one event loop kept for the worker's life.

    Requests carry their episode's id and are answered as they finish, so
    the episodes a worker hosts (``episodes_per_worker``) wait on each other
    only where an environment blocks the loop with code that does not await.
    """

    def __init__(self, settings: EnvironmentSettings, factory: Callable[[], Environment], conn: Connection) -> None:
        self.settings = settings
        self.factory = factory
        self.conn = conn
        self.envs: dict[int, Environment] = {}

    async def serve(self) -> None:
        """Answer requests until the socket closes."""
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()
        answering: set[asyncio.Task[None]] = set()
        fd = self.conn.fileno()

        def readable() -> None:
            try:
                request = json.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                loop.remove_reader(fd)
                if not closed.done():
                    closed.set_result(None)
                return
            task = loop.create_task(self.answer(request))
            answering.add(task)
            task.add_done_callback(answering.discard)

        loop.add_reader(fd, readable)
        await closed

    async def answer(self, request: dict[str, Any]) -> None:
        try:
            self.conn.send_bytes(await self.handle(request))
        except OSError:  # the generator is gone: the parent watch ends this worker
            pass

    async def handle(self, request: dict[str, Any]) -> bytes:
        """The reply to ``request``, under the request's id; its episode's environment by the episode's id."""
        rid = request.get("id")
        try:
            body = await self._run(int(request.get("episode", 0)), request)
            encoded = json.dumps({"ok": True, "id": rid, **body}).encode()
        except _Oversize as exc:
            return _error("oversize", str(exc), rid)
        except InvalidOutput as exc:
            return _error("invalid", str(exc), rid)
        except (Exception, SystemExit) as exc:  # the environment's own failure: reported, the worker goes on
            return _error("raised", f"{type(exc).__name__}: {exc}", rid)
        if len(encoded) > self.settings.max_observation_bytes + REPLY_OVERHEAD_BYTES:
            return _error("oversize", f"{len(encoded)} bytes, over max_observation_bytes", rid)
        return encoded

    async def _run(self, episode: int, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "reset":
            env = self.envs[episode] = self.factory()
            task = EnvTask.model_validate(request["task"])
            messages, tools = check_reset(await env.reset(task))
            self._check_size({"messages": messages, "tools": tools})
            return {"messages": messages, "tools": tools}
        if op == "step":
            if episode not in self.envs:
                raise RuntimeError("step before reset")
            result = check_step(await self.envs[episode].step(request["turn"]))
            self._check_size(result.observation)
            return {"observation": result.observation, "reward": result.reward, "done": result.done}
        if op == "close":
            close = getattr(self.envs.pop(episode, None), "close", None)
            if callable(close):
                value = close()
                if asyncio.iscoroutine(value):
                    await value
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


def _error(kind: FailureReason, detail: str, rid: object = None) -> bytes:
    return json.dumps({"ok": False, "id": rid, "kind": kind, "error": detail[:MAX_ERROR_CHARS]}).encode()


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
    asyncio.run(_Host(settings, factory, conn).serve())


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
    """One worker process and the calls in flight to it (one per episode it hosts), each matched to its reply
    by a request id: the late reply of a call given up on is dropped, never taken for another's."""

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
        self.hosted = 0
        """Episodes leased on this worker."""
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._request_ids = itertools.count(1)
        self._loop.add_reader(self.conn.fileno(), self._readable)

    async def started(self) -> None:
        """Wait for the worker's ready message; ConfigError with its error when the environment cannot load."""
        try:
            reply = await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT_S)
        except TimeoutError:
            self.kill("it did not start")
            raise ConfigError(f"an environment worker did not start within {START_TIMEOUT_S:g}s") from None
        except EnvFailure as exc:
            raise ConfigError(f"an environment worker did not start: {exc.detail}") from None
        if not reply["ok"]:
            raise ConfigError(str(reply["error"]))

    async def call(self, episode: int, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The worker's reply to ``episode``'s ``request``; EnvFailure when it fails. A call past its time limit
        kills the worker, and with it the calls of the other episodes it hosts (``crashed``)."""
        if self.broken:
            raise EnvFailure("crashed", "the worker is gone")
        rid = next(self._request_ids)
        reply: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._calls[rid] = reply
        try:
            try:
                self.conn.send_bytes(json.dumps({**request, "episode": episode, "id": rid}).encode())
            except OSError as exc:
                self.kill(f"the worker is gone ({exc})")
            got = await asyncio.wait_for(reply, timeout_s)
        except TimeoutError:
            self.kill(f"another episode's call ran past {timeout_s:g}s")
            raise EnvFailure("timeout", f"no answer within {timeout_s:g}s; the worker was killed") from None
        finally:
            self._calls.pop(rid, None)
        if not got["ok"]:
            raise EnvFailure(got["kind"], str(got["error"]))
        return got

    def _readable(self) -> None:
        """A reply arrived (or the socket closed): hand it to its call."""
        try:
            # Bounded: a worker cannot make this process read an unbounded message.
            data = self.conn.recv_bytes(self.max_reply_bytes)
        except EOFError:
            self.kill(f"the worker died (exit code {self._exitcode()})")
            return
        except OSError as exc:  # longer than the bound: the reply is not read, the pipe is unusable
            self.kill(f"the worker's reply exceeds {self.max_reply_bytes} bytes ({exc})", reason="oversize")
            return
        reply: dict[str, Any] = json.loads(data)
        if not self._ready.done():
            self._ready.set_result(reply)
            return
        waiting = self._calls.get(reply.get("id"))  # type: ignore[arg-type]
        if waiting is not None and not waiting.done():
            waiting.set_result(reply)
        # else: the reply of a call given up on (cancelled): nothing waits for it

    def _exitcode(self) -> int | None:
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, why: str = "the pool closed", reason: FailureReason = "crashed") -> None:
        """Stop the worker; every call still waiting on it fails with ``reason`` and ``why``."""
        if not self.broken:
            self.broken = True
            with contextlib.suppress(ValueError, OSError, RuntimeError):  # RuntimeError: the loop is closed
                self._loop.remove_reader(self.conn.fileno())
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5.0)
        self.conn.close()
        if self._loop.is_closed():
            return
        failure = EnvFailure(reason, why)
        for waiting in [self._ready, *self._calls.values()]:
            if not waiting.done():
                waiting.set_exception(failure)
        if self._ready.done() and not self._ready.cancelled():
            self._ready.exception()  # retrieved: a worker killed before anyone waited is no error to log


class EnvSession:
    """One episode's environment, in the worker leased for it."""

    def __init__(self, worker: _Worker, episode: int, settings: EnvironmentSettings) -> None:
        self._worker = worker
        self._episode = episode
        self.settings = settings

    async def reset(self, task: EnvTask) -> tuple[list[Message], list[dict[str, Any]]]:
        request = {"op": "reset", "task": task.model_dump()}
        reply = await self._worker.call(self._episode, request, self.settings.tool_timeout_s)
        return reply["messages"], reply["tools"]

    async def step(self, assistant_turn: str) -> StepResult:
        request = {"op": "step", "turn": assistant_turn}
        reply = await self._worker.call(self._episode, request, self.settings.tool_timeout_s)
        return StepResult(observation=reply["observation"], reward=reply["reward"], done=reply["done"])


class EnvironmentPool:
    """Leases a worker for each episode (see the module docstring): at most ``num_workers`` workers, each
    hosting at most ``episodes_per_worker`` episodes at once; more episodes wait."""

    def __init__(self, settings: EnvironmentSettings) -> None:
        self.settings = settings
        self._workers: list[_Worker] = []
        self._slots = asyncio.Semaphore(settings.num_workers * settings.episodes_per_worker)
        self._next_episode = 0
        self.num_started = 0
        """Workers started so far (replacements of killed ones included)."""

    async def start(self) -> None:
        """Start one worker, so that an environment that cannot load fails here (ConfigError), once."""
        worker = self._spawn()
        try:
            await worker.started()
        except BaseException:
            self._drop(worker)
            raise

    def _spawn(self) -> _Worker:
        worker = _Worker(self.settings)
        self.num_started += 1
        self._workers.append(worker)
        return worker

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        if worker in self._workers:
            self._workers.remove(worker)

    def _lease(self) -> _Worker:
        """The live worker with the most episodes that still has room (filling workers before starting more),
        or a new one."""
        room = [w for w in self._workers if not w.broken and w.hosted < self.settings.episodes_per_worker]
        worker = max(room, key=lambda w: w.hosted) if room else self._spawn()
        worker.hosted += 1
        return worker

    @contextlib.asynccontextmanager
    async def episode(self) -> AsyncIterator[EnvSession]:
        """A worker for one episode, given back (its environment closed) after it; a worker that failed is
        replaced by a new one for a later episode."""
        async with self._slots:
            for dead in [w for w in self._workers if w.broken and w.hosted == 0]:
                self._drop(dead)
            worker = self._lease()
            self._next_episode += 1
            episode = self._next_episode
            try:
                try:
                    await worker.started()
                except ConfigError as exc:  # it loaded in the first worker: this one is broken
                    worker.kill(str(exc))
                    raise EnvFailure("crashed", f"a new worker did not start: {exc}") from exc
                yield EnvSession(worker, episode, self.settings)
            finally:
                worker.hosted -= 1
                await self._give_back(worker, episode)

    async def _give_back(self, worker: _Worker, episode: int) -> None:
        if not worker.broken:
            try:
                await worker.call(episode, {"op": "close"}, self.settings.tool_timeout_s)
            except EnvFailure as exc:
                log.warning("closing an environment failed, its worker is replaced: %s", exc)
                worker.kill(f"closing another episode's environment failed: {exc}")
        if worker.broken and worker.hosted == 0:
            self._drop(worker)

    def close(self) -> None:
        """Stop every worker (a stuck one is killed)."""
        for worker in self._workers:
            worker.kill()
        self._workers.clear()
