"""Environments in worker processes: each way an environment can fail ends only its episode, with its reason.

One pool of real spawned workers runs an environment that misbehaves as
each task asks (raises, hangs, returns garbage, sends an oversize
observation, exits); after every failure a well-behaved episode runs on
the same pool. A hang is cut at the time limit (measured, not slept), its
worker killed and replaced; failures the worker reports itself leave the
worker in service.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from asymptote.envs import EnvFailure, EnvironmentPool, EnvironmentSettings, EnvTask
from asymptote.errors import ConfigError
from tests.envs.tool_classes import ENVS_PYTHON

TIMEOUT_S = 1.0
SETTINGS = EnvironmentSettings(
    entry="tests.envs.tool_classes:Misbehaves", tool_timeout_s=TIMEOUT_S, max_observation_bytes=4096, num_workers=2
)


@pytest.fixture(scope="module")
async def pool() -> AsyncIterator[EnvironmentPool]:
    p = EnvironmentPool(SETTINGS)
    await p.start()
    try:
        yield p
    finally:
        p.close()


async def well_behaved(pool: EnvironmentPool) -> None:
    async with pool.episode() as env:
        messages, tools = await env.reset(EnvTask(prompt="Count.", reference="well"))
        assert [m["role"] for m in messages] == ["system", "user"]
        assert tools[0]["function"]["name"] == "count"
        first = await env.step("abc")
        assert first.model_dump() == {
            "observation": [{"role": "tool", "name": "count", "content": "3 characters"}],
            "reward": None,
            "done": False,
        }
        last = await env.step("de")
        assert (last.observation, last.reward, last.done) == ([], 2.0, True)


async def test_workers_are_reused_between_episodes(pool: EnvironmentPool) -> None:
    before = pool.num_started
    for _ in range(3):
        await well_behaved(pool)
    assert pool.num_started == before


@pytest.mark.parametrize(
    ("mode", "reason", "detail", "replaced"),
    [
        ("raise", "raised", "RuntimeError: the environment's own bug", False),
        ("garbage", "invalid", "step returned an invalid observation: 1 error(s), first at 0.content", False),
        ("role", "invalid", "step returned an invalid observation: 1 error(s), first at 0.role", False),
        ("oversize", "oversize", "bytes; max_observation_bytes is 4096", False),
        ("crash", "crashed", "the worker died (exit code 3)", True),
        ("hang", "timeout", f"no answer within {TIMEOUT_S:g}s; the worker was killed", True),
        ("reset-hang", "timeout", f"no answer within {TIMEOUT_S:g}s; the worker was killed", True),
    ],
)
async def test_a_failing_environment_ends_only_its_episode(
    pool: EnvironmentPool, mode: str, reason: str, detail: str, replaced: bool
) -> None:
    await well_behaved(pool)  # a worker is idle: the failure below happens in a started worker
    started = pool.num_started
    t0 = time.monotonic()
    with pytest.raises(EnvFailure) as caught:
        async with pool.episode() as env:
            await env.reset(EnvTask(prompt="Count.", reference=mode))
            await env.step("abc")
    elapsed = time.monotonic() - t0
    assert caught.value.reason == reason
    assert detail in caught.value.detail
    if reason == "timeout":
        assert TIMEOUT_S <= elapsed < TIMEOUT_S + 2.0
    await well_behaved(pool)
    # A worker that hung or died is replaced by a new one; one that reported the failure serves on.
    assert pool.num_started == started + int(replaced)


async def test_episodes_beyond_the_workers_wait_for_one(pool: EnvironmentPool) -> None:
    await asyncio.gather(*(well_behaved(pool) for _ in range(6)))
    assert len(pool._workers) <= SETTINGS.num_workers


async def test_a_worker_hosts_several_episodes_each_with_its_own_environment() -> None:
    """Six episodes at once on two workers of three each: every one plays as on a worker of its own."""
    pool = EnvironmentPool(SETTINGS.model_copy(update={"episodes_per_worker": 3}))
    await pool.start()
    try:
        await asyncio.gather(*(well_behaved(pool) for _ in range(6)))
        assert pool.num_started == 2
        await asyncio.gather(*(well_behaved(pool) for _ in range(3)))  # the workers are reused
        assert pool.num_started == 2
    finally:
        pool.close()


async def test_a_call_past_its_limit_ends_the_episodes_that_share_its_worker() -> None:
    """The cost of sharing: a step that hangs blocks its worker's loop, so the worker is killed at the limit
    and the episode beside it ends too (``crashed``, saying why); the next episode gets a new worker."""
    pool = EnvironmentPool(SETTINGS.model_copy(update={"episodes_per_worker": 2, "num_workers": 1}))
    await pool.start()
    try:
        async with pool.episode() as beside, pool.episode() as hung:
            await beside.reset(EnvTask(prompt="Count.", reference="well"))
            await hung.reset(EnvTask(prompt="Count.", reference="hang"))
            hanging = asyncio.ensure_future(hung.step("abc"))
            # The hanging call's deadline comes well before the call beside it: both run out within one turn
            # of the loop otherwise, and the call beside would time out on its own.
            await asyncio.sleep(TIMEOUT_S / 3)
            with pytest.raises(EnvFailure) as caught:
                await beside.step("abc")
            assert (caught.value.reason, caught.value.detail) == (
                "crashed",
                f"another episode's call ran past {TIMEOUT_S:g}s",
            )
            with pytest.raises(EnvFailure, match="timeout"):
                await hanging
        await well_behaved(pool)
        assert pool.num_started == 2
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("entry", "kind", "message"),
    [
        ("tests.envs.absent:Nothing", "environment", "cannot be imported: No module named 'tests.envs.absent'"),
        ("tests.envs.tool_classes:Message", "environment", "lacks reset and step"),
        ("tests.envs.tool_classes:Calculator", "environment", "lacks reset and step; a plain class of tools"),
        ("tests.envs.tool_classes:NoDocstring", "tools", "tool NoDocstring.add has no docstring"),
        ("tests.envs.tool_classes:os", "environment", "is a module, not a class"),
    ],
)
async def test_an_environment_that_cannot_load_fails_at_start(entry: str, kind: str, message: str) -> None:
    settings = SETTINGS.model_copy(update={"entry": entry, "kind": kind})
    pool = EnvironmentPool(settings)
    try:
        with pytest.raises(ConfigError) as caught:
            await pool.start()
        assert message in str(caught.value)
    finally:
        pool.close()


async def where(settings: EnvironmentSettings) -> dict[str, Any]:
    pool = EnvironmentPool(settings)
    try:
        await pool.start()
        async with pool.episode() as env:
            messages, _ = await env.reset(EnvTask(prompt="Where?"))
        return dict(json.loads(messages[0]["content"]))
    finally:
        pool.close()


async def test_workers_run_on_the_environment_s_own_interpreter() -> None:
    settings = SETTINGS.model_copy(update={"entry": "tests.envs.tool_classes:WhereAmI"})
    assert await where(settings) == {"prefix": sys.prefix, "torch": True, "openenv": False}
    own = await where(settings.model_copy(update={"python": str(ENVS_PYTHON)}))
    assert own == {"prefix": str(ENVS_PYTHON.parents[1]), "torch": False, "openenv": True}


async def test_an_environment_python_that_does_not_run_fails_at_start(tmp_path: Path) -> None:
    pool = EnvironmentPool(SETTINGS.model_copy(update={"python": str(tmp_path / "absent" / "python")}))
    with pytest.raises(ConfigError) as caught:
        await pool.start()
    assert f"environment python {str(tmp_path / 'absent' / 'python')!r} cannot be started" in str(caught.value)
