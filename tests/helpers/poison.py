"""Hundreds of malformed and invalid messages for every subject, to mix into a live run
(tests/e2e/test_local_stack.py): each must land in the dead-letter stream with a reason, no service
may restart, and the good traffic must all be trained (the ledger balances).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter

from asymptote.config import NatsSettings
from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.connect import connect
from asymptote.jetstream.names import Names
from tests.helpers.badinput import BAD_INPUTS

INTERFACE = "NATS subjects"
RANDOM_PER_SUBJECT = 60
SEED = 20261122


def _group(**overrides: object) -> rollout_pb2.RolloutGroup:
    task = rollout_pb2.GenerationTask(
        task_id="poison",
        kind=rollout_pb2.TASK_KIND_TRAIN,
        task_name="arithmetic",
        prompt_id="p",
        prompt="1+2=",
        reference="3",
    )
    completions = [
        rollout_pb2.Completion(
            token_ids=[5, 6],
            logprobs=[-0.1, -0.2],
            reward=r,
            version_spans=[rollout_pb2.VersionSpan(version=0, start=0, end=2)],
        )
        for r in (0.0, 1.0)
    ]
    g = rollout_pb2.RolloutGroup(group_id="poison", task=task, prompt_token_ids=[1, 2], completions=completions)
    for k, v in overrides.items():
        setattr(g, k, v) if not callable(v) else v(g)
    return g


def invalid_rollouts() -> list[bytes]:
    def c0(g: rollout_pb2.RolloutGroup) -> rollout_pb2.Completion:
        return g.completions[0]

    cases = [
        _group(group_id=""),
        _group(completions=lambda g: g.ClearField("completions")),
        _group(prompt_token_ids=lambda g: g.ClearField("prompt_token_ids")),
        _group(completions=lambda g: c0(g).logprobs.append(-1.0)),  # more log-probs than tokens
        _group(completions=lambda g: c0(g).logprobs.__setitem__(0, math.nan)),
        _group(completions=lambda g: c0(g).logprobs.__setitem__(0, 0.5)),  # a probability above 1
        _group(completions=lambda g: setattr(c0(g), "reward", math.inf)),
        _group(completions=lambda g: c0(g).loss_mask.extend([1, 1, 1])),
        _group(completions=lambda g: c0(g).version_spans.__getitem__(0).__setattr__("end", 1)),
        _group(completions=lambda g: c0(g).token_ids.__delitem__(slice(None))),
    ]
    return [g.SerializeToString() for g in cases]


def invalid_tasks() -> list[bytes]:
    base = {
        "task_id": "poison-task",
        "kind": rollout_pb2.TASK_KIND_TRAIN,
        "task_name": "arithmetic",
        "prompt_id": "p",
        "prompt": "1+2=",
        "reference": "3",
    }
    sampling = rollout_pb2.SamplingParams(num_samples=4, temperature=1.0, max_tokens=4)
    cases = [
        rollout_pb2.GenerationTask(**{**base, "task_id": ""}, sampling=sampling),
        rollout_pb2.GenerationTask(**{**base, "prompt": ""}, sampling=sampling),
        rollout_pb2.GenerationTask(**{**base, "kind": 7}, sampling=sampling),
        rollout_pb2.GenerationTask(**{**base, "task_name": "no-such-task"}, sampling=sampling),
        rollout_pb2.GenerationTask(
            **base, sampling=rollout_pb2.SamplingParams(num_samples=0, temperature=1, max_tokens=4)
        ),
        rollout_pb2.GenerationTask(
            **base, sampling=rollout_pb2.SamplingParams(num_samples=4, temperature=0, max_tokens=4)
        ),
        rollout_pb2.GenerationTask(
            **base, sampling=rollout_pb2.SamplingParams(num_samples=4, temperature=1, max_tokens=0)
        ),
        rollout_pb2.GenerationTask(
            **base, sampling=rollout_pb2.SamplingParams(num_samples=99999, temperature=1, max_tokens=4)
        ),
    ]
    return [t.SerializeToString() for t in cases]


def invalid_evals() -> list[bytes]:
    ok = {
        "eval_id": "eval-v999",
        "task_id": "t",
        "prompt_id": "p",
        "num_samples": 4,
        "num_correct": 1,
        "eval_num_prompts": 10,
    }
    cases = [
        rollout_pb2.EvalResult(**{**ok, "eval_id": ""}),
        rollout_pb2.EvalResult(**{**ok, "task_id": ""}),
        rollout_pb2.EvalResult(**{**ok, "num_samples": 0}),
        rollout_pb2.EvalResult(**{**ok, "num_correct": 9}),
        rollout_pb2.EvalResult(**{**ok, "eval_num_prompts": 0}),
    ]
    return [e.SerializeToString() for e in cases]


def invalid_telemetry() -> list[bytes]:
    ok = {
        "service": "generator",
        "instance_id": "x",
        "num_devices": 1,
        "device_seconds_total": 10.0,
        "busy_seconds_total": 5.0,
        "unix_s": time.time(),
    }
    cases = [
        rollout_pb2.ComputeTelemetry(**{**ok, "service": ""}),
        rollout_pb2.ComputeTelemetry(**{**ok, "service": "toaster"}),
        rollout_pb2.ComputeTelemetry(**{**ok, "instance_id": ""}),
        rollout_pb2.ComputeTelemetry(**{**ok, "device_seconds_total": math.nan}),
        rollout_pb2.ComputeTelemetry(**{**ok, "busy_seconds_total": -1.0}),
    ]
    return [t.SerializeToString() for t in cases]


def random_payloads(rng: random.Random, n: int) -> list[bytes]:
    # Bytes that are not a protobuf of the subject's type (0xff never starts a valid field key),
    # or empty / one-byte messages that decode to an empty, invalid message.
    out = [b"", b"\x00"]
    while len(out) < n:
        out.append(b"\xff" + rng.randbytes(rng.randint(1, 300)))
    return out


async def inject(nats: NatsSettings, names: Names) -> Counter[str]:
    rng = random.Random(SEED)
    nc = await connect(nats, "poison")
    js = nc.jetstream()
    plan = {
        "tasks": (names.train_tasks, invalid_tasks()),
        "rollouts": (names.rollouts, invalid_rollouts()),
        "evals": (names.eval_results, invalid_evals()),
        "telemetry": (names.telemetry, invalid_telemetry()),
    }
    sent: Counter[str] = Counter()
    try:
        for source, (subject, structured) in plan.items():
            payloads = structured + random_payloads(rng, RANDOM_PER_SUBJECT)
            rng.shuffle(payloads)
            for data in payloads:
                await js.publish(subject, data)
                BAD_INPUTS.record(INTERFACE, [subject.encode(), data])
                sent[source] += 1
                await asyncio.sleep(0.005)  # pacing: interleaved with the live traffic, not a wait for an event
    finally:
        await nc.close()
    return sent


async def deadletters(nats: NatsSettings, names: Names) -> Counter[str]:
    nc = await connect(nats, "poison-check")
    js = nc.jetstream()
    got: Counter[str] = Counter()
    try:
        info = await js.stream_info(names.deadletter_stream)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(names.deadletter_stream, seq)
            assert (msg.headers or {}).get("Asymptote-Reason"), f"dead letter {seq} on {msg.subject} has no reason"
            got[msg.subject.rsplit(".", 1)[-1]] += 1
    finally:
        await nc.close()
    return got
