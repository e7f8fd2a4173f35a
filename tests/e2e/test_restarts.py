"""The broker, nats-server and the learner die mid-run; nothing is lost or trained twice.

The local stack supervises its processes as Kubernetes would. This test
SIGKILLs the broker, later nats-server (file storage), later the learner,
while the learner is training, lets the stack restart them, and then audits
the ledger: every issued train task is trained exactly once into the weights
that continue, filtered with a reason, dead-lettered, or still in a queue;
the learner resumes from its last checkpoint and the policy version never
goes backwards.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from services.local.config import StackConfig
from services.local.progress import Progress, read_jsonl
from services.local.stack import LocalStack

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 40
FAULTS = [(8, "broker"), (18, "nats-server"), (29, "learner")]
"""(learner step at which to kill, process)."""


def inject(stack: LocalStack, stop: threading.Event, done: list[tuple[int, str, float]]) -> None:
    pending = list(FAULTS)
    while pending and not stop.is_set():
        steps = read_jsonl(stack.run_dir / "metrics.jsonl")
        step = steps[-1]["step"] if steps else 0
        if step >= pending[0][0]:
            _, name = pending.pop(0)
            stack.kill(name)
            done.append((step, name, time.time()))
        time.sleep(0.2)


@pytest.mark.e2e
@pytest.mark.faults
def test_broker_nats_and_learner_restarts_lose_nothing(tmp_path: Path) -> None:
    config = StackConfig(
        run_dir=tmp_path / "run",
        cache_dir=REPO / ".cache" / "asymptote",
        max_steps=MAX_STEPS,
        batch_prompts=16,
        eval_every_versions=20,
        checkpoint_every_steps=4,
        startup_timeout_s=240,
    )
    stack = LocalStack(config)
    stack.run_dir.mkdir(parents=True)
    model_dir = stack.prepare_model()
    progress = Progress(stack.run_dir, config.max_steps)
    stop = threading.Event()
    injected: list[tuple[int, str, float]] = []
    try:
        stack.start_nats()
        stack.start_services(stack.write_configs(model_dir))
        injector = threading.Thread(target=inject, args=(stack, stop, injected), daemon=True)
        injector.start()
        assert progress.follow(stack, config) == 0, progress.outcome
        stop.set()
        injector.join(5)
        assert [name for _, name, _ in injected] == [name for _, name in FAULTS]

        ledger = stack.audit_ledger()
        assert ledger is not None
        print("ledger:", json.dumps({k: v for k, v in ledger.items() if k != "examples"}))
        restarts = read_jsonl(stack.run_dir / "restarts.jsonl")
        assert sorted(r["service"] for r in restarts) == ["broker", "learner", "nats-server"]

        rows = read_jsonl(stack.run_dir / "metrics.jsonl")
        versions = [r["policy_version"] for r in rows]
        assert versions == sorted(set(versions)), "the policy version went backwards or repeated"
        # The learner resumed from its last checkpoint: the steps after the
        # crash repeat those trained since that checkpoint, which were lost.
        resumed = next(i for i in range(1, len(rows)) if rows[i]["step"] <= rows[i - 1]["step"])
        ckpt_step = rows[resumed]["step"] - 1
        assert ckpt_step % config.checkpoint_every_steps == 0
        lost = [r for r in rows[:resumed] if r["step"] > ckpt_step]
        kept = rows[: resumed - len(lost)] + rows[resumed:]
        assert [r["step"] for r in kept] == list(range(1, MAX_STEPS + 1))
        trained_groups = sum(int(r["batch/prompts"]) for r in kept)
        print(f"learner resumed at step {ckpt_step + 1}; {len(lost)} uncheckpointed steps retrained")
        assert ledger["lost"] == 0, ledger["examples"]
        assert ledger["trained_twice"] == 0, ledger["examples"]
        assert ledger["ended_twice"] == 0, ledger["examples"]
        assert ledger["never_issued"] == 0, ledger["examples"]
        # Every group the learner trained is in the ledger exactly once, and
        # every issued task is accounted for.
        assert ledger["trained"] == trained_groups
        accounted = (
            ledger["trained"] + sum(ledger["filtered"].values()) + ledger["deadlettered"] + ledger["in_flight"]
        )
        assert accounted == ledger["issued"]
    finally:
        stop.set()
        stack.stop()
        progress.finish(stack)
    assert all(p.popen.poll() is not None for p in stack.procs)
