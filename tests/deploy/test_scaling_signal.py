"""The gauge the chart's autoscalers follow: asymptote_broker_desired_generators.

KEDA and the HPA target one generator per unit of it, so its value is the
replica count they converge on. Checked through the broker's own pipeline
object and its exported registry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import generate_latest

import services.broker.pipeline as pipeline_module
from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names
from asymptote.tasks import ArithmeticSettings
from services.broker.config import BrokerConfig
from services.broker.metrics import BrokerMetrics
from services.broker.pipeline import BrokerPipeline

BATCH = 16


def pipeline(num_active: int, num_stale: int = 0) -> BrokerPipeline:
    config = BrokerConfig(task=ArithmeticSettings(num_train=40, num_heldout=3, max_digits=2), batch_prompts=BATCH)
    p = BrokerPipeline(config, None, Names(), None, None, BrokerMetrics())  # type: ignore[arg-type]
    now = time.monotonic()
    for i in range(num_active):
        p._generators_seen[f"gen-{i}"] = now - 1.0
    for i in range(num_stale):  # gone quiet for over a minute: no longer counted
        p._generators_seen[f"gone-{i}"] = now - 120.0
    return p


def with_ready(p: BrokerPipeline, num_ready: int, num_pending: int) -> BrokerPipeline:
    p.batcher.ready.extend([object()] * num_ready)  # type: ignore[list-item]
    p.pending_tasks = num_pending
    return p


@pytest.mark.parametrize(
    ("active", "stale", "ready", "pending", "desired"),
    [
        (4, 0, BATCH, 10, 4),  # a full batch waits: the learner is fed, keep what runs
        (4, 0, 2 * BATCH - 1, 0, 4),  # ahead by under two batches: keep what runs
        (4, 0, 2 * BATCH, 0, 3),  # two batches waiting: the learner is the bottleneck, one fewer
        (1, 0, 3 * BATCH, 0, 1),  # never below one
        (4, 0, 0, 10, 6),  # learner starved, work queued: +ceil(1.0 * 4 * 0.5)
        (4, 0, BATCH // 2, 10, 5),  # half a batch waiting: +ceil(0.5 * 4 * 0.5)
        (10, 0, BATCH // 4, 30, 14),  # +ceil(0.75 * 10 * 0.5) = +4
        (4, 0, 0, 0, 4),  # starved but nothing issued yet: more generators would idle
        (0, 0, 0, 10, 2),  # nobody has reported yet: counts as one, starved: +1
        (2, 3, 0, 10, 3),  # generators silent for a minute are not counted
    ],
)
def test_desired_generators(active: int, stale: int, ready: int, pending: int, desired: int) -> None:
    p = with_ready(pipeline(active, stale), ready, pending)
    assert p.desired_generators() == desired


def test_the_gauge_exports_the_formula() -> None:
    p = with_ready(pipeline(4), 0, 10)
    p._update_gauges()
    text = generate_latest(p.metrics.registry).decode()
    samples: dict[str, Any] = dict(
        line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(samples["asymptote_broker_desired_generators"]) == 6.0


@pytest.mark.parametrize(("pending", "desired"), [(0, 0), (5, 6)])
def test_a_finished_run_wants_no_generators(monkeypatch: pytest.MonkeyPatch, pending: int, desired: int) -> None:
    """The learner's final version (max_steps) takes the gauge to 0 once its tasks are answered, so KEDA can idle the pools."""
    p = with_ready(pipeline(4), 0, 10)
    assert p.desired_generators() == 6

    async def final_policy(*_: Any) -> AsyncIterator[rollout_pb2.PolicyVersion]:
        yield rollout_pb2.PolicyVersion(version=2000, step=2000, final=True)

    async def no_eval_round(*_: Any) -> None:
        return None

    monkeypatch.setattr(pipeline_module, "watch_policy", final_policy)
    monkeypatch.setattr(p, "_issue_eval_round_retrying", no_eval_round)
    asyncio.run(p.policy_loop(asyncio.Event()))
    assert p.run_finished
    p.pending_tasks = pending  # the final eval round, still out or answered
    p._update_gauges()
    text = generate_latest(p.metrics.registry).decode()
    samples = dict(line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples["asymptote_broker_desired_generators"]) == desired
