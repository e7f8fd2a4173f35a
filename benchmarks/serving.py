"""The learner's step while it serves a version every step, against the step alone, on two gloo ranks.

Owns the serving-overhead benchmark: a ~107M-parameter model (quick: 0.9M)
trained by the learner's ``Trainer`` on two torchrun ranks (gloo, one
thread a rank, DDP as ``parallelism: auto`` picks on the CPU). Rank 0 runs
blocks of steps in turn:

- **alone**: the optimizer step;
- **serving**: the step, then the weights copied out in bf16
  (``WeightStore.stage``, the part that must see them before the next step
  moves them), their digest and ``put`` handed to a thread that runs beside
  the next step, as ``Learner.serve`` does; the previous version's digest
  is awaited before the next copy;
- **inline** (for reference, the learner before): the step, then the copy
  and the digest on the step's path; their seconds give the serving rate
  (a version's bytes copied out and digested per second).

The figure is the median seconds a step takes serving over the median
alone, side by side in one run.

    python -m benchmarks.serving --output DIR [--quick]

Target: serving / alone <= 1.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.figure import Figure, Target, write_and_print
from benchmarks.learner_memory import model_spec, torchrun

TARGET = 1.1
BENCH_FILE_NAME = "serving_bench.json"
MODES = ("alone", "serving", "inline")


def worker(quick: bool, out: Path) -> None:
    """Both ranks: the model, DDP, and rank 0's blocks of steps in each mode (the other rank follows)."""
    import torch

    from asymptote.tasks import ALPHABET
    from benchmarks.learner import synthetic_groups
    from services.embedded.build import build_model, build_tokenizer
    from services.learner.config import LossSettings, OptimizerSettings
    from services.learner.distributed import DataParallel
    from services.learner.model import count_parameters
    from services.learner.trainer import Trainer, collate
    from services.learner.weights import Staged, WeightStore, served_signature

    torch.set_num_threads(1)
    dp = DataParallel.from_env("gloo")
    torch.manual_seed(0)
    tokenizer = build_tokenizer(ALPHABET, 16)
    trainer = Trainer(build_model(model_spec(quick), tokenizer), LossSettings(), OptimizerSettings(), dp)
    if not dp.is_main:
        trainer.follow()
        trainer.close()
        dp.close()
        return
    groups = synthetic_groups(len(tokenizer), num_prompts=8, group_size=4, prompt_len=16, max_new=24)
    inputs = collate(groups, int(tokenizer.pad_token_id))
    store = WeightStore(served_signature(trainer.model, "bfloat16"), keep=2)
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
    publishing: Future[Any] | None = None
    times: dict[str, list[float]] = {m: [] for m in MODES}
    version = 0
    blocks, steps_each = (2, 2) if quick else (4, 3)

    serve_s: list[float] = []
    """Seconds each version took to copy out and digest, inline: the serving rate."""

    def stage() -> Staged:
        return store.stage(version, trainer.served_tensors(store.names))

    for _ in range(blocks):
        for mode in MODES:
            for i in range(steps_each + 1):
                t0 = time.perf_counter()
                trainer.step(inputs, learner_version=version)
                version += 1
                if mode == "serving":
                    if publishing is not None:
                        publishing.result()
                    publishing = background.submit(store.publish, stage())
                elif mode == "inline":
                    served_from = time.perf_counter()
                    store.publish(stage())
                    serve_s.append(time.perf_counter() - served_from)
                if i:  # the block's first step warms up (and lets the last block's digest finish)
                    times[mode].append(time.perf_counter() - t0)
            if publishing is not None:
                publishing.result()
                publishing = None
    background.shutdown()
    served = store.get()
    assert served is not None
    record = {
        "num_parameters": count_parameters(trainer.model),
        "served_bytes": served.num_bytes,
        "samples_per_step": int(inputs.rewards.numel()),
        "serve_s": serve_s,
        **times,
    }
    (out / "serving.json").write_text(json.dumps(record))
    trainer.release_followers()
    trainer.close()
    dp.close()


def bench_serving(quick: bool, workdir: Path) -> Figure:
    """Two ranks under torchrun (see the module docstring); the figure from rank 0's record."""
    workdir.mkdir(parents=True, exist_ok=True)
    torchrun(2, ["--worker", "--workdir", str(workdir), *(["--quick"] if quick else [])], module="benchmarks.serving")
    r = json.loads((workdir / "serving.json").read_text())
    alone, serving, inline = (statistics.median(r[m]) for m in MODES)
    serve_gb_per_s = r["served_bytes"] / statistics.median(r["serve_s"]) / 1e9
    return Figure(
        name="learner_step_serving_every_step_vs_alone",
        value=serving,
        unit="s",
        ratio=serving / alone,
        baseline=f"the step alone {alone * 1e3:.0f} ms",
        measured=(
            f"the step serving a {r['served_bytes'] / 1e6:.0f} MB bf16 version every step {serving * 1e3:.0f} ms "
            f"(digest beside the next step; inline, as before: {inline * 1e3:.0f} ms; a version copied out and "
            f"digested at {serve_gb_per_s:.2f} GB/s), "
            f"{r['num_parameters'] / 1e6:.0f}M parameters, two gloo ranks, median of {len(r['serving'])}"
        ),
        targets=(Target(of="ratio", direction="at most", bound=TARGET),),
        details={
            **r,
            "alone_s": alone,
            "serving_s": serving,
            "inline_s": inline,
            "inline_ratio": inline / alone,
            "serve_gb_per_s": serve_gb_per_s,
        },
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help=f"directory for {BENCH_FILE_NAME}")
    parser.add_argument("--quick", action="store_true", help="a 0.9M-parameter model and fewer steps")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.quick, args.workdir)
        return 0
    if args.output is None:
        parser.error("--output is required")
    figure = bench_serving(args.quick, args.output / "serving")
    write_and_print([figure], args.output / BENCH_FILE_NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
