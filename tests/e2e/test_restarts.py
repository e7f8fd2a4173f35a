"""Services die mid-run, by SIGKILL and by SIGTERM; nothing is lost or trained twice.

The local stack supervises its processes as Kubernetes would. This test
kills the broker, nats-server (file storage), the learner and the generator
with SIGKILL, and stops the broker, learner, generator and fitter with
SIGTERM (graceful drain), each at a learner step drawn from a seeded random
schedule (``ASY_FAULT_SEED`` replays one); then failpoints kill the
generator with its engine paused mid-swap, the learner with a checkpoint
half written and the learner mid-step. It lets the stack restart them, and
then audits the ledger: every issued train task is trained exactly once
into the weights that continue, filtered with a reason, dead-lettered, or
still in a queue; the learner resumes from its last checkpoint and the
policy version never goes backwards.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.local.progress import read_jsonl
from services.local.stack import LocalStack
MAX_STEPS = 96
FAULTS = [
    ("broker", signal.SIGKILL),
    ("nats-server", signal.SIGKILL),
    ("learner", signal.SIGKILL),
    ("generator-0", signal.SIGKILL),
    ("broker", signal.SIGTERM),
    ("learner", signal.SIGTERM),
    ("generator-0", signal.SIGTERM),
    ("fitter", signal.SIGTERM),
]


# Faults inside the windows a random signal rarely hits (asymptote/faults.py),
# armed after the random schedule's last step: (service, progress to fire at).
FAILPOINTS = {
    "generator.swap.paused": ("generator-0", 72),  # engine paused mid-swap, requests held
    "learner.checkpoint.written": ("learner", 76),  # checkpoint files written, not yet committed
    "learner.step.trained": ("learner", 82),  # weights stepped in memory, nothing announced
}


def schedule(seed: int) -> list[tuple[int, str, signal.Signals]]:
    """Faults in a seeded order, at seeded steps at least 6 apart."""
    rng = random.Random(seed)
    faults = FAULTS[:]
    rng.shuffle(faults)
    step, plan = 2, []
    for name, sig in faults:
        step += rng.randint(6, 8)
        plan.append((step, name, sig))
    assert plan[-1][0] < MAX_STEPS - 2
    return plan


def inject(
    stack: LocalStack, plan: list[tuple[int, str, signal.Signals]], stop: threading.Event, done: list[str]
) -> None:
    """Inject each fault once its step is reached and the stack has recovered from the last."""

    def step() -> int:
        rows = read_jsonl(stack.run_dir / "metrics.jsonl")
        return int(rows[-1]["step"]) if rows else 0

    pending = list(plan)
    not_before = 0
    while pending and not stop.is_set():
        time.sleep(0.2)
        if step() < max(pending[0][0], not_before) or not all(p.ready for p in stack.procs if p.http_port):
            continue
        _, name, sig = pending.pop(0)
        proc = next(p for p in stack.procs if p.name == name)
        restarts = proc.restarts
        stack.kill(name, sig)
        done.append(f"{name}:{sig.name}")
        # Recovered: the process was restarted, every service reported ready
        # since, and the learner moved on.
        while not stop.is_set() and proc.restarts == restarts:
            time.sleep(0.2)
        time.sleep(1.0)  # let the readiness poll see the restarted process
        not_before = step() + 2


def kept_rows(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """The learner steps whose weights continued (steps lost to a crash are dropped)."""
    kept: list[dict[str, object]] = []
    for row in rows:
        while kept and int(kept[-1]["step"]) >= int(row["step"]):  # type: ignore[arg-type]
            kept.pop()  # trained after the checkpoint the learner resumed from
        kept.append(row)
    return kept


@pytest.mark.e2e
@pytest.mark.faults
def test_faults_lose_nothing_and_train_nothing_twice(launch: Callable[..., Any], tmp_path: Path) -> None:
    seed = int(os.environ.get("ASY_FAULT_SEED", random.SystemRandom().randrange(1 << 30)))
    plan = schedule(seed)
    print(f"fault seed {seed} (replay with ASY_FAULT_SEED={seed}): "
          + ", ".join(f"{n}:{s.name}@{st}" for st, n, s in plan))
    stop = threading.Event()
    injected: list[str] = []
    with launch(
        max_steps=MAX_STEPS, batch_prompts=16, eval_every_versions=24, checkpoint_every_steps=4,
        failpoints=",".join(f"{name}:{at}" for name, (_, at) in FAILPOINTS.items()),
    ) as (stack, progress):
        config = stack.config
        injector = threading.Thread(target=inject, args=(stack, plan, stop, injected), daemon=True)
        injector.start()
        completed = progress.follow(stack, config) == 0
        stop.set()
        injector.join(5)

        ledger = stack.audit_ledger()
        assert ledger is not None
        fired = sorted(p.stem for p in (stack.run_dir / "failpoints").glob("*.fired"))
        report = {
            "seed": seed,
            "faults_injected": dict(Counter(injected + [f"{FAILPOINTS[f][0]}:failpoint {f}" for f in fired])),
            "groups_issued": ledger["issued"],
            "groups_lost": ledger["lost"],
            "groups_trained_twice": ledger["trained_twice"],
            "run_completed": completed,
            "ledger": {k: v for k, v in ledger.items() if k != "examples"},
        }
        (tmp_path / "fault-report.json").write_text(json.dumps(report, indent=2))
        print("fault report:", json.dumps(report))
        assert completed, progress.outcome
        assert injected == [f"{n}:{s.name}" for _, n, s in plan]
        assert fired == sorted(FAILPOINTS), "a failpoint was never reached"
        restarts = Counter(r["service"] for r in read_jsonl(stack.run_dir / "restarts.jsonl"))
        assert restarts == Counter(n for _, n, _ in plan) + Counter(service for service, _ in FAILPOINTS.values())

        rows = read_jsonl(stack.run_dir / "metrics.jsonl")
        versions = [r["policy_version"] for r in rows]
        assert versions == sorted(set(versions)), "the policy version went backwards or repeated"
        kept = kept_rows(rows)
        assert [r["step"] for r in kept] == list(range(1, MAX_STEPS + 1))
        assert ledger["lost"] == 0, ledger["examples"]
        assert ledger["trained_twice"] == 0, ledger["examples"]
        assert ledger["ended_twice"] == 0, ledger["examples"]
        assert ledger["never_issued"] == 0, ledger["examples"]
        # Every group in the continuing weights is in the ledger as trained,
        # once, and every issued task is accounted for.
        assert ledger["trained"] == sum(int(r["batch/prompts"]) for r in kept)
        accounted = (
            ledger["trained"] + sum(ledger["filtered"].values()) + ledger["deadlettered"] + ledger["in_flight"]
        )
        assert accounted == ledger["issued"]
        stop.set()
    assert all(p.popen.poll() is not None for p in stack.procs)
