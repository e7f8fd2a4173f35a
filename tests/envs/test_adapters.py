"""Environments written for other libraries, run by the pool on the environments' own interpreter.

An OpenEnv environment written against OpenEnv's public API
(tests/envs/openenv_guess.py) runs in-process in the worker and behind
OpenEnv's own server reached by its client; both give the same episode:
the task's prompt then the reset observation, one user message per
observation, the action filled with the turn after its reasoning, the
reward that comes with done. Settings that do not fit the entry are
refused at start with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from asymptote.envs import EnvironmentPool, EnvironmentSettings, EnvTask
from asymptote.envs.config import OpenEnvSettings, VerifiersSettings
from asymptote.envs.pool import worker_path
from asymptote.nats_local import free_port
from tests.envs.tool_classes import ENVS_PYTHON
from tests.helpers.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
GUESS = "tests.envs.openenv_guess"
IN_WORKER = EnvironmentSettings(
    entry=f"{GUESS}:GuessEnvironment",
    kind="openenv",
    openenv=OpenEnvSettings(action=f"{GUESS}:GuessAction", action_field="guess"),
    python=str(ENVS_PYTHON),
    tool_timeout_s=30.0,
    num_workers=1,
)
MCP_ENV = IN_WORKER.model_copy(
    update={"entry": "tests.envs.openenv_mcp:Arithmetic", "openenv": OpenEnvSettings(mcp=True)}
)
SERVER_START_S = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """OpenEnv's FastAPI app for the game under uvicorn, on the environments' interpreter; its base URL."""
    port = free_port()  # below the ephemeral range: no outgoing socket takes it before the server binds
    process = subprocess.Popen([str(ENVS_PYTHON), "-m", GUESS, str(port)], cwd=REPO)

    def listening() -> bool:
        assert process.poll() is None, f"the OpenEnv server exited with {process.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return False
        return True

    try:
        wait_until(listening, SERVER_START_S, "the OpenEnv server to listen")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(timeout=10)


def through_server(base_url: str) -> EnvironmentSettings:
    openenv = IN_WORKER.openenv
    assert openenv is not None
    return IN_WORKER.model_copy(
        update={
            "entry": f"{GUESS}:GuessClient",
            "openenv": openenv.model_copy(update={"base_url": base_url}),
        }
    )


VERIFIERS = "tests.envs.verifiers_envs"
TOOL_ENV = EnvironmentSettings(
    entry=f"{VERIFIERS}:load_tool_env",
    kind="verifiers",
    verifiers=VerifiersSettings(env_args={"max_turns": 3}),
    python=str(ENVS_PYTHON),
    tool_timeout_s=30.0,
    num_workers=1,
)
COUNTDOWN = TOOL_ENV.model_copy(update={"entry": f"{VERIFIERS}:Countdown", "verifiers": None})


@pytest.fixture(scope="module")
async def pools(server: str) -> AsyncIterator[dict[str, EnvironmentPool]]:
    """A started pool for each environment (a worker imports openenv or verifiers once: seconds)."""
    started = {
        "in the worker": EnvironmentPool(IN_WORKER),
        "async reset": EnvironmentPool(IN_WORKER.model_copy(update={"entry": f"{GUESS}:AsyncGuessEnvironment"})),
        "mcp": EnvironmentPool(MCP_ENV),
        "behind its server": EnvironmentPool(through_server(server)),
        "tools": EnvironmentPool(TOOL_ENV),
        "countdown": EnvironmentPool(COUNTDOWN),
    }
    try:
        await asyncio.gather(*(pool.start() for pool in started.values()))
        yield started
    finally:
        for pool in started.values():
            pool.close()


async def play(
    pool: EnvironmentPool, turns: list[str], prompt: str = "Find the secret number.", reference: str = "7"
) -> list[tuple[object, ...]]:
    """The first messages, then (observation, reward, done) of each turn, in one episode."""
    async with pool.episode() as env:
        messages, tools = await env.reset(EnvTask(task_id="t1", prompt=prompt, reference=reference))
        out: list[tuple[object, ...]] = [(messages, tools)]
        for turn in turns:
            result = await env.step(turn)
            out.append((result.observation, result.reward, result.done))
    return out


FIRST = [{"role": "user", "content": "Find the secret number.\n\nGuess the number. You have 3 guesses."}]


@pytest.mark.parametrize("where", ["in the worker", "behind its server", "async reset"])
async def test_an_openenv_environment_plays_an_episode(where: str, pools: dict[str, EnvironmentPool]) -> None:
    pool = pools[where]
    assert await play(pool, ["<think>start low</think> 3", "<think>up</think>9", "7"]) == [
        (FIRST, []),
        ([{"role": "user", "content": "higher"}], None, False),
        ([{"role": "user", "content": "lower"}], None, False),
        ([], 1.0, True),
    ]
    # Out of guesses: the reward that comes with done, 0.
    assert (await play(pool, ["1", "2", "3"]))[-1] == ([], 0.0, True)


CALL_ADD = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


async def test_an_openenv_mcp_environment_offers_its_tools_and_answers_each_call(
    pools: dict[str, EnvironmentPool],
) -> None:
    pool = pools["mcp"]
    bad_calls = (
        '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>\n'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>\n<tool_call>{bad</tool_call>'
    )
    first, added, failed, answered = await play(pool, [CALL_ADD, bad_calls, "The sum is 5."], prompt="Add 2, 3.")
    messages, tools = first
    # No observation to show at reset: the prompt alone; the tools as ListToolsAction gives them.
    assert messages == [{"role": "user", "content": "Add 2, 3."}]
    by_name = {t["function"]["name"]: t for t in tools}  # type: ignore[attr-defined]
    assert set(by_name) == {"add", "divide", "submit"} and all(t["type"] == "function" for t in tools)  # type: ignore[attr-defined]
    add = by_name["add"]["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert added == ([{"role": "tool", "name": "add", "content": "5"}], None, False)
    # Each failed call is a tool message that says why, in order; the episode goes on.
    observation, reward, done = failed
    assert (reward, done) == (None, False)
    assert [m["name"] for m in observation] == ["divide", "nope", "error"]  # type: ignore[attr-defined]
    assert all(m["content"].startswith("Error: ") for m in observation)  # type: ignore[attr-defined]
    assert "zero" in observation[0]["content"] and "nope" in observation[1]["content"]  # type: ignore[index]
    assert answered == ([], None, True)  # a turn without calls is the answer: the verifier judges it
    # A call the environment ends the episode with carries its reward.
    submit = '<tool_call>{"name": "submit", "arguments": {"answer": "%s"}}</tool_call>'
    assert (await play(pool, [submit % "7"]))[-1] == ([], 1.0, True)
    assert (await play(pool, [submit % "6"]))[-1] == ([], 0.0, True)


async def test_a_verifiers_tool_env_plays_its_tools_and_its_rubric(pools: dict[str, EnvironmentPool]) -> None:
    first, called, answered = await play(pools["tools"], [CALL_ADD, "The answer is 5."], "What is 2 + 3?", "5")
    messages, tools = first
    assert messages == [
        {"role": "system", "content": "Use the add tool, then say the answer."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    assert tools == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "properties": {
                        "a": {"description": "The first addend.", "title": "A", "type": "integer"},
                        "b": {"description": "The second addend.", "title": "B", "type": "integer"},
                    },
                    "required": ["a", "b"],
                    "title": "add_args",
                    "type": "object",
                    "additionalProperties": False,
                },
            },
        }
    ]
    assert called == ([{"role": "tool", "name": "add", "content": "5"}], None, False)
    assert answered == ([], 1.0, True)  # the rubric: the answer holds the reference
    assert (await play(pools["tools"], [CALL_ADD, "The answer is 6."], "What is 2 + 3?", "5"))[-1] == ([], 0.0, True)
    # Out of turns (max_turns 3 from env_args): the environment's own stop, its rubric's reward.
    assert (await play(pools["tools"], [CALL_ADD] * 3, "What is 2 + 3?", "5"))[-1] == ([], 0.0, True)


async def test_a_verifiers_multiturn_env_answers_each_turn_as_the_user(pools: dict[str, EnvironmentPool]) -> None:
    assert await play(pools["countdown"], ["3", "2", "1"], "Say 3.", "") == [
        ([{"role": "user", "content": "Say 3."}], []),
        ([{"role": "user", "content": "2"}], None, False),
        ([{"role": "user", "content": "1"}], None, False),
        ([], 1.0, True),
    ]
    assert (await play(pools["countdown"], ["3", "two", "1"], "Say 3.", ""))[-1] == ([], 2 / 3, True)


MISFITS = [
    ({"entry": f"{GUESS}:GuessClient"}, "is not an OpenEnv Environment subclass, as openenv without base_url"),
    ({"action_field": "answer"}, "openenv action_field 'answer' is not a field of GuessAction (its fields:"),
    ({"action": f"{GUESS}:GuessObservation"}, "is not a field of GuessObservation"),
    ({"action": f"{GUESS}:MAX_GUESSES"}, f"openenv action '{GUESS}:MAX_GUESSES' is not an OpenEnv Action class"),
]
VERIFIERS_MISFITS = [
    (f"{VERIFIERS}:NotAnEnvironment", "made a NotAnEnvironment, not a verifiers Environment"),
    (f"{VERIFIERS}:ANSWER_SHOWN", "is a str, not a load_environment function or an environment class"),
    (f"{VERIFIERS}:absent", "cannot be imported"),
]
LOAD_EACH = """
import json, sys
from asymptote.envs.config import EnvironmentSettings
from asymptote.envs.pool import load_factory
from asymptote.errors import ConfigError
said = []
for settings in json.loads(sys.stdin.read()):
    try:
        load_factory(EnvironmentSettings.model_validate(settings))
        said.append(None)
    except ConfigError as exc:
        said.append(str(exc))
print(json.dumps(said))
"""


def test_settings_that_do_not_fit_the_entry_are_refused_with_the_reason() -> None:
    """What a worker's start reports (the pool turns it into a ConfigError at start: tests/envs/test_pool.py);
    all cases in one interpreter, since each import of openenv takes seconds."""
    openenv = IN_WORKER.openenv
    assert openenv is not None
    cases = []
    for update, _ in MISFITS:
        fields = dict(update)
        entry = fields.pop("entry", IN_WORKER.entry)
        cases.append(IN_WORKER.model_copy(update={"entry": entry, "openenv": openenv.model_copy(update=fields)}))
    cases += [COUNTDOWN.model_copy(update={"entry": entry}) for entry, _ in VERIFIERS_MISFITS]
    done = subprocess.run(
        [str(ENVS_PYTHON), "-c", LOAD_EACH],
        input=json.dumps([c.model_dump(mode="json") for c in [IN_WORKER, *cases]]),
        env={**os.environ, "PYTHONPATH": worker_path()},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said[0] is None  # the well-fitting settings load
    for (_, message), got in zip([*MISFITS, *VERIFIERS_MISFITS], said[1:], strict=True):
        assert got is not None and message in got, (message, got)


def test_kind_openenv_and_its_settings_go_together() -> None:
    with pytest.raises(ValueError, match="kind openenv takes the openenv settings"):
        EnvironmentSettings(entry=IN_WORKER.entry, kind="openenv")
    with pytest.raises(ValueError, match="kind openenv takes the openenv settings"):
        EnvironmentSettings(entry=IN_WORKER.entry, openenv=IN_WORKER.openenv)
    # An MCP environment's actions are OpenEnv's own: no Action class or field with mcp, one without.
    with pytest.raises(ValueError, match="openenv mcp takes no action or action_field"):
        OpenEnvSettings(action=f"{GUESS}:GuessAction", action_field="guess", mcp=True)
    with pytest.raises(ValueError, match="openenv takes action and action_field"):
        OpenEnvSettings(action=f"{GUESS}:GuessAction")
    assert OpenEnvSettings(mcp=True).action is None
