"""An eval round holds its generator on the version it names, within a bound.

The swapper's own loop (``Swapper.swap_loop``) against a stand-in engine
that only records the versions it is given: a newer version announced while
an eval task at the engine's version is leased waits until the task is
done; one more than ``max_versions`` ahead goes through at once, as does one
an eval task is waiting for, and a hold of 0 never waits. (The rollout loop
leasing and releasing eval tasks over real NATS and vLLM:
tests/generator/test_swap.py.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asymptote.contracts.v1 import rollout_pb2
from services.generator.engine import SwapReport
from services.generator.metrics import GeneratorMetrics
from services.generator.swapper import EvalHold, Swapper
from services.generator.weights import GrpcWeightSource
from tests.helpers.waiting import wait_until_async


class Recorded:
    """A swap target that loads nothing: it takes the version it is given."""

    def __init__(self, version: int) -> None:
        self.version = version

    async def swap(self, weights_path: Path, version: int, mode: str) -> SwapReport:
        raise AssertionError("update() is replaced here")


class RecordingSwapper(Swapper):
    loaded: list[int]

    async def update(self, policy: rollout_pb2.PolicyVersion) -> bool:
        self.loaded.append(int(policy.version))
        self.engine.version = int(policy.version)
        return True


def swapper(tmp_path: Path, engine: Recorded, hold: EvalHold, metrics: GeneratorMetrics) -> RecordingSwapper:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.zeros(2)}, str(model / "model.safetensors"))
    s = RecordingSwapper(engine, GrpcWeightSource(), model, tmp_path / "staged", "inflight", metrics, hold=hold)
    s.loaded = []
    return s


def announce(s: Swapper, version: int) -> None:
    s.latest = rollout_pb2.PolicyVersion(version=version)
    s._announced.set()


async def test_a_leased_eval_task_holds_newer_versions_within_the_bound(tmp_path: Path) -> None:
    engine, hold, metrics = Recorded(3), EvalHold(max_versions=2), GeneratorMetrics()
    s = swapper(tmp_path, engine, hold, metrics)
    stop = asyncio.Event()
    loop = asyncio.create_task(s.swap_loop(stop))
    try:
        hold.begin(1, 3)  # an eval task of the round issued at version 3, leased
        announce(s, 4)

        async def held_a_while() -> bool:
            return metrics.swap_held_s._value.get() > 0.0

        await wait_until_async(held_a_while, 10, "the swap to version 4 to be held")
        assert s.loaded == [] and engine.version == 3
        hold.end(1)  # the round's last task at version 3 is done: the swap goes on at once

        async def loaded(versions: list[int]) -> bool:
            return s.loaded == versions

        await wait_until_async(lambda: loaded([4]), 5, "version 4 after the round")

        hold.begin(2, 4)
        announce(s, 7)  # three ahead, more than max_versions: swapped while the round runs
        await wait_until_async(lambda: loaded([4, 7]), 5, "version 7 past the bound")

        hold.begin(3, 8)  # a round that waits for version 8 does not hold the swap to it
        hold.end(2)
        announce(s, 8)
        await wait_until_async(lambda: loaded([4, 7, 8]), 5, "version 8, which the eval task waits for")
    finally:
        stop.set()
        await asyncio.wait_for(loop, 5)


def test_the_hold_follows_the_versions_of_the_leased_eval_tasks() -> None:
    hold = EvalHold(max_versions=4)
    assert not hold.holds(5, 6)  # nothing leased
    hold.begin(10, 5)
    hold.begin(11, 5)
    assert hold.holds(5, 6) and hold.holds(5, 9) and not hold.holds(5, 10)
    hold.end(10)
    assert hold.holds(5, 6)  # another task of the round still leased
    hold.end(11)
    hold.end(11)  # ending twice is harmless
    assert not hold.holds(5, 6)
    hold.begin(12, 7)
    assert not hold.holds(5, 6)  # an eval task waiting for version 7 holds nothing below it
    off = EvalHold(max_versions=0)
    off.begin(1, 5)
    assert not off.holds(5, 6)


def test_a_negative_bound_is_refused_by_the_config() -> None:
    from pydantic import ValidationError

    from services.generator.config import GeneratorConfig

    with pytest.raises(ValidationError, match="eval_hold_versions"):
        GeneratorConfig.model_validate({"engine": {"model_dir": "/m"}, "eval_hold_versions": -1})
