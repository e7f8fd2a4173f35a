"""A generator refuses a task whose digest is not the one it holds, over a real nats-server.

A real broker issues tasks of one task (arithmetic of up to two digits); a
real rollout loop configured with another (up to three digits, the
default) takes them. Each is dead-lettered before anything is sampled
(the loop's engine is never started: the check comes first), with a reason
naming both digests, and every refused train task is counted in the
ledger as dead-lettered: none lost, none twice.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_broker_nats import Harness, running, stream_count

from asymptote.compute import ComputeMeter
from asymptote.contracts.v1 import rollout_pb2
from asymptote.ledger import audit, read_entries
from asymptote.nats_local import NatsServer
from asymptote.tasks import ArithmeticSettings, task_digest
from services.generator.config import EngineSettings
from services.generator.engine import Engine
from services.generator.metrics import GeneratorMetrics
from services.generator.rollout import RolloutLoop
from services.generator.scoring import TaskScorer
from tests.helpers.waiting import wait_until_async

NUM_REFUSED_TRAIN = 8


async def test_a_task_of_another_digest_is_dead_lettered_with_both_digests_and_counted(
    nats: NatsServer, tmp_path: Path
) -> None:
    async with running(Harness(nats)) as h:
        broker_task = h.config.task
        generator_task = ArithmeticSettings()  # three digits: another task than the broker's
        theirs, ours = task_digest(broker_task), task_digest(generator_task)
        assert theirs != ours
        metrics = GeneratorMetrics()
        loop = RolloutLoop(
            Engine(EngineSettings(model_dir=tmp_path)),  # never started: nothing may reach it
            h.js,
            h.names,
            "generator-test",
            max_inflight_groups=4,
            ack_wait_s=30.0,
            metrics=metrics,
            meter=ComputeMeter("generator", "generator-test", "cpu", 1),
            scorer=TaskScorer(generator_task, tmp_path, metrics),
        )
        stop = asyncio.Event()
        generating = asyncio.create_task(loop.run(stop))

        async def refused_train() -> int:
            entries = await read_entries(h.js, h.names)
            n = sum(1 for e in entries if e.event == rollout_pb2.LEDGER_EVENT_DEADLETTERED)
            return n if n >= NUM_REFUSED_TRAIN else 0

        try:
            await wait_until_async(refused_train, 60, f"{NUM_REFUSED_TRAIN} refused train tasks in the ledger")
        finally:
            stop.set()
            await asyncio.wait_for(generating, 60)

        # Every dead letter on the tasks subject names both digests.
        sub = await h.js.subscribe(h.names.deadletter("tasks"), ordered_consumer=True)
        num_letters = await stream_count(h, h.names.deadletter_stream)
        letters = [await sub.next_msg(timeout=5) for _ in range(num_letters)]
        await sub.unsubscribe()
        kinds = [rollout_pb2.GenerationTask.FromString(m.data).kind for m in letters]
        for m in letters:
            reason = (m.headers or {})["Asymptote-Reason"]
            assert f"carries task digest {theirs}" in reason and f"this generator holds {ours}" in reason, reason
        num_train = kinds.count(rollout_pb2.TASK_KIND_TRAIN)
        num_eval = kinds.count(rollout_pb2.TASK_KIND_EVAL)
        print(f"dead-lettered: {num_train} train, {num_eval} eval tasks; reason: {letters[0].headers}")
        assert num_eval == 3  # the first version's eval round, three held-out prompts

        # Nothing was sampled or published; the refusals are counted.
        assert await stream_count(h, h.names.rollouts_stream) == 0
        assert await stream_count(h, h.names.evals_stream) == 0
        errors = metrics.registry.get_sample_value("asymptote_generator_task_errors_total", {"reason": "task_digest"})
        assert errors == num_train + num_eval

        # The ledger: every refused train task dead-lettered, the rest still queued; none lost, none twice.
        result = await audit(h.js, h.names)
        print("audit:", {k: v for k, v in result.as_dict().items() if k != "examples"})
        assert result.ok, result.as_dict()
        assert result.deadlettered == num_train >= NUM_REFUSED_TRAIN
        assert result.lost == [] and result.trained_twice == [] and result.ended_twice == []
        assert result.issued == result.deadlettered + result.in_flight
