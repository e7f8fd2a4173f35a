"""Run under torchrun by test_fail_fast.py: the learner's trainer on two ranks, an exception injected mid-step.

Rank 0 leads steps as the learner service does and the other ranks follow
(``Trainer.follow``), each inside ``failing_fast`` as the service's ranks
are. A failpoint armed by the test (``learner.step.backward.rank<R>:N:raise``)
raises in the middle of a step on one rank. ``--swallow`` is the must-fail
twin: rank 0 catches the exception and goes on as the learner once did (its
final checkpoint gathered the whole state, a collective) instead of failing.

``--wait-s S --timeout-s T``: no exception; rank 0 first waits S seconds (as
for data), longer than the collectives' timeout T, sending the other ranks a
heartbeat every ``--heartbeat-s`` seconds (0: none), then takes a step.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch

from services.learner.config import LossSettings, OptimizerSettings
from services.learner.distributed import DataParallel, failing_fast
from services.learner.trainer import Trainer, collate
from tests.learner.ddp_worker import batch, tiny_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--swallow", action="store_true")
    parser.add_argument("--wait-s", type=float, default=0.0)
    parser.add_argument("--heartbeat-s", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dp = DataParallel.from_env("gloo", timeout_s=args.timeout_s)
    (args.out / f"pid.rank{dp.rank}").write_text(str(os.getpid()))
    trainer = Trainer(tiny_model(), LossSettings(), OptimizerSettings(lr=1e-2), dp, parallelism="fsdp")
    if dp.is_main and args.swallow:
        rng = random.Random(7)
        try:
            for step in range(args.steps):
                trainer.step(collate(batch(rng, step, 5), pad_id=0), learner_version=step)
        except Exception:
            trainer.full_state()  # what the learner's shutdown did after a failed step: a collective
        trainer.release_followers()
    elif dp.is_main:
        with failing_fast(dp, "rank 0"):
            waited_until = time.monotonic() + args.wait_s
            while (left := waited_until - time.monotonic()) > 0:  # waiting for data, as the learner does
                time.sleep(min(left, args.heartbeat_s or left))
                if args.heartbeat_s:
                    trainer.heartbeat()
            rng = random.Random(7)
            for step in range(args.steps):
                trainer.step(collate(batch(rng, step, 5), pad_id=0), learner_version=step)
            trainer.release_followers()
    else:
        with failing_fast(dp, f"rank {dp.rank}"):
            trainer.follow()
    trainer.close()
    dp.close()


if __name__ == "__main__":
    main()
