"""The best held-out round travels from the fitter to the learner's pruning over a real nats-server.

The fitter's evals loop takes eval rounds off the stream, writes them to
``eval.jsonl`` and publishes the best in the run's KV bucket; what the
learner reads there decides which checkpoint pruning keeps beside the
newest. A fitter restarted on the same run publishes the best of the rounds
its ``eval.jsonl`` holds before it takes any new one.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats
import pytest

from asymptote.best_round import current_best_round
from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names, ensure_bucket, ensure_streams
from asymptote.nats_local import NatsServer
from services.fitter.collector import RunCollectors
from services.fitter.compute_axis import ComputeAxis
from services.fitter.curve import CurveFitSettings
from services.fitter.main import evals_loop
from services.learner import checkpoint
from tests.helpers.fitcheck import eval_round
from tests.helpers.waiting import wait_until_async

_ids = itertools.count()


async def run_fitter(rt: Any, run_dir: Path, stop: asyncio.Event) -> asyncio.Task[None]:
    collector = RunCollectors(
        run_dir, "run", CurveFitSettings(num_bootstrap_resamples=10), (2.0,), ComputeAxis(30.0), plot=False
    )
    return asyncio.create_task(evals_loop(rt, collector, stop))


async def test_the_learner_keeps_the_checkpoint_of_the_round_the_fitter_scored_best(
    nats_server_url: str, tmp_path: Path
) -> None:
    nc = await nats.connect(nats_server_url)
    js = nc.jetstream()
    names = Names(f"best{next(_ids)}")
    await ensure_streams(js, names)
    rt = SimpleNamespace(js=js, names=names)
    kv = await ensure_bucket(js, names.evals_bucket)
    root = tmp_path / "checkpoints"

    async def best() -> rollout_pb2.BestRound | None:
        return await current_best_round(kv, names)

    async def scored(num_rounds: int) -> rollout_pb2.BestRound:
        async def ready() -> bool:
            found = await best()
            return found is not None and found.num_rounds == num_rounds

        await wait_until_async(ready, 30.0, f"the fitter to publish the best of {num_rounds} rounds")
        found = await best()
        assert found is not None
        return found

    stop = asyncio.Event()
    fitter = await run_fitter(rt, tmp_path, stop)
    try:
        assert await best() is None  # no round scored: nothing published, the learner prunes as it always did
        for version, rate in [(0, 0.2), (10, 0.6), (20, 0.4), (30, 0.5)]:
            for result in eval_round(version, rate):
                await js.publish(names.eval_results, result.SerializeToString())
        got = await scored(4)
        assert (got.policy_version, got.pass_rate) == (10, pytest.approx(0.6))
        # The learner's side: checkpoints 10..30 on disk, keep_checkpoints 1.
        for v in (10, 20, 30):
            checkpoint.final_path(root, v).mkdir(parents=True)
            (checkpoint.final_path(root, v) / "DONE").touch()
        checkpoint.prune(root, 1, got)
        assert [checkpoint.version_of(p) for p in checkpoint.committed(root)] == [10, 30]
        for result in eval_round(40, 0.7):
            await js.publish(names.eval_results, result.SerializeToString())
        got = await scored(5)
        assert got.policy_version == 40
        checkpoint.final_path(root, 40).mkdir()
        (checkpoint.final_path(root, 40) / "DONE").touch()
        checkpoint.prune(root, 1, got)
        assert [checkpoint.version_of(p) for p in checkpoint.committed(root)] == [40]  # 10 superseded
    finally:
        stop.set()
        await fitter

    # A fitter restarted on the run, its entry gone (a new NATS store), publishes eval.jsonl's best at start.
    await kv.delete(names.best_round_key)
    stop = asyncio.Event()
    fitter = await run_fitter(rt, tmp_path, stop)
    try:
        got = await scored(5)
        assert (got.policy_version, got.pass_rate) == (40, pytest.approx(0.7))
    finally:
        stop.set()
        await fitter
        await nc.close()


@pytest.fixture
def nats_server_url(nats: NatsServer) -> str:
    return nats.url
