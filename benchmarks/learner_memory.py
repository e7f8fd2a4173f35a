"""Learner memory per rank with FSDP2 over two ranks against one rank, and FSDP2's step time against DDP's.

Owns the sharding benchmarks. A Llama of about 100M parameters (built from
a config with random weights, no download) takes optimizer steps through
the learner's ``Trainer`` under torchrun (gloo, one thread a rank), once on
one rank and once sharded over two, with and without activation
checkpointing, all in one invocation. Per rank it reports:

- tensor bytes: the peak, over two steps, of the bytes held in tensors
  (parameters, gradients, AdamW state, activations, and the layers FSDP2
  gathers): the storages live before the steps (parameters, buffers, the
  batch) plus the largest net total the CPU allocator had handed out since
  they began, from the PyTorch profiler's memory events
  (``profile_memory=True``: every allocation and free, FSDP2's storage
  resizes included); beside it the parameter, gradient and optimizer-state
  storages the rank holds after the steps;
- peak RSS (``ru_maxrss``) and the RSS after the steps, before and after
  ``malloc_trim(0)``: the CPU allocator keeps what freed tensors held, so
  RSS shrinks less than the tensors do. One pair of runs fixes glibc's
  mmap threshold at 1 MiB (``ALLOCATOR_ENV``) and builds the sharded model
  on the meta device (each rank allocates only its shards), to see how far
  RSS follows the tensors.

It also times a step of the embedded default's tiny model under DDP and
under FSDP2 on two gloo ranks, alternating the two layouts, which is what
``parallelism: auto`` rests on.

    python -m benchmarks.learner_memory --output DIR [--quick]

Targets: two-rank per-rank tensor bytes <= 0.65 of one rank's (with and
without activation checkpointing; peak RSS is held to the same bound and
reported whether or not it meets it); FSDP2 / DDP step time >= 1 on the CPU,
the measurement behind ``auto`` choosing DDP there. ``--quick`` runs a
model of 0.9M parameters and leaves out the activation-checkpointing,
meta-device and allocator runs (its RSS figure compares the plain runs;
the activation-checkpointing figure is reported not run).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.figure import Figure, Target, not_run, write_and_print

BENCH_FILE_NAME = "learner_memory_bench.json"
TARGET = 0.65
TARGETS = (Target(of="ratio", direction="at most", bound=TARGET),)
FIGURE = "learner_memory_fsdp2_2_ranks_vs_1"
"""Two ranks' per-rank bytes against one rank's."""
MB = 1e6
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
"""glibc serves blocks above the threshold with mmap and unmaps them when freed. By default the
threshold rises to the largest block freed (up to 32 MiB), after which layer-sized buffers come
from the heap and what they held stays resident; a fixed threshold turns that off."""


@dataclass(frozen=True)
class Variant:
    """One torchrun launch of the worker."""

    name: str
    ranks: int
    activation_checkpointing: bool = False
    meta_init: bool = False
    mmap_threshold: bool = False
    """glibc's mmap threshold fixed at 1 MiB (``ALLOCATOR_ENV``)."""


VARIANTS = (
    Variant("one", 1),
    Variant("fsdp2", 2),
    Variant("one-ac", 1, activation_checkpointing=True),
    Variant("fsdp2-ac", 2, activation_checkpointing=True),
    Variant("one-mmap", 1, mmap_threshold=True),
    Variant("fsdp2-meta-mmap", 2, meta_init=True, mmap_threshold=True),
)


def model_spec(quick: bool) -> Any:
    from services.embedded.build import ModelSpec

    if quick:
        return ModelSpec(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384, max_position_embeddings=128)
    # 14 x (4 x 768^2 + 3 x 768 x 2304) = 107M parameters.
    return ModelSpec(hidden_size=768, num_layers=14, num_heads=12, intermediate_size=2304, max_position_embeddings=128)


# -- the worker: one rank of one variant ------------------------------------


def rss_bytes() -> int:
    """This process's resident set now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def malloc_trim() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def held_bytes(trainer: Any) -> dict[str, int]:
    """Bytes of the storages this rank holds for parameters, gradients and AdamW state (each counted once)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    seen: set[int] = set()

    def total(tensors: list[torch.Tensor]) -> int:
        n = 0
        for t in tensors:
            storage = local(t).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                n += storage.nbytes()
        return n

    params = list(trainer.model.parameters())
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": total(params),
        "gradients": total([p.grad for p in params if p.grad is not None]),
        "optimizer_state": total([v for v in state if v.numel() > 1]),
    }


def profiled_peak(step: Any) -> int:
    """Run ``step()`` under the profiler; the largest net bytes it had allocated at any moment.

    The profiler's memory events carry the CPU allocator's running total of
    what was allocated since profiling began (``total_allocated``); its
    maximum plus what was live before is the peak of tensor bytes.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    assert prof.profiler is not None
    peak = 0
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            peak = max(peak, int(event.typed[1].total_allocated))
    return peak


def worker(variant: Variant, quick: bool, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from asymptote.tasks import ALPHABET
    from benchmarks.learner import synthetic_groups
    from services.embedded.build import build_tokenizer, model_config
    from services.learner.config import LossSettings, OptimizerSettings
    from services.learner.distributed import DataParallel
    from services.learner.model import count_parameters
    from services.learner.trainer import Trainer, collate

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dp = DataParallel.from_env("gloo")
    tokenizer = build_tokenizer(ALPHABET, 16)
    config = model_config(model_spec(quick), tokenizer)
    with torch.device("meta" if variant.meta_init else "cpu"):
        model = AutoModelForCausalLM.from_config(config)
    num_params = count_parameters(model)
    trainer = Trainer(
        model,
        LossSettings(),
        OptimizerSettings(warmup_steps=0),
        dp,
        parallelism="fsdp",
        activation_checkpointing=variant.activation_checkpointing,
    )
    if variant.meta_init:
        trainer.init_random()  # allocated on the meta device, each rank its shards: initialise them
    groups = synthetic_groups(len(tokenizer), num_prompts=4, group_size=2, prompt_len=16, max_new=32, seed=1)
    inputs = collate(groups, int(tokenizer.pad_token_id))

    def steps() -> None:
        if dp.is_main:
            for _ in range(2):  # AdamW allocates its state in the first
                trainer.step(inputs, learner_version=0)
            trainer.release_followers()
        else:
            trainer.follow()

    before = held_bytes(trainer)
    before["buffers"] = sum(b.untyped_storage().nbytes() for b in model.buffers())
    before["batch"] = sum(
        t.untyped_storage().nbytes() for t in (inputs.batch.input_ids, inputs.batch.attention_mask, inputs.logp_gen)
    )
    started = time.perf_counter()
    peak = sum(before.values()) + profiled_peak(steps)
    step_s = time.perf_counter() - started
    report = {
        "variant": variant.name,
        "rank": dp.rank,
        "ranks": dp.world_size,
        "sharded": trainer.sharded,
        "num_parameters": num_params,
        "tokens_per_step": int(inputs.batch.attention_mask.numel()),
        "peak_tensor_bytes": peak,
        "bytes_before_steps": before,
        "held_bytes": held_bytes(trainer),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_bytes": rss_bytes(),
        "two_steps_s": step_s,
    }
    malloc_trim()
    report["rss_after_trim_bytes"] = rss_bytes()
    (out / f"{variant.name}.rank{dp.rank}.json").write_text(json.dumps(report))
    trainer.close()
    dp.close()


def step_time_worker(quick: bool, out: Path, rounds: int) -> None:
    """DDP and FSDP2 steps of the tiny default model on two ranks, alternating layouts each round."""
    import torch

    from asymptote.tasks import ALPHABET
    from benchmarks.learner import synthetic_groups
    from services.embedded.build import ModelSpec, build_model, build_tokenizer
    from services.learner.config import LossSettings, OptimizerSettings
    from services.learner.distributed import DataParallel
    from services.learner.trainer import Trainer, collate

    torch.set_num_threads(1)
    dp = DataParallel.from_env("gloo")
    tokenizer = build_tokenizer(ALPHABET, 16)
    groups = synthetic_groups(len(tokenizer), num_prompts=16, group_size=8, prompt_len=8, max_new=7)
    inputs = collate(groups, int(tokenizer.pad_token_id))
    steps_each = 2 if quick else 8
    times: dict[str, list[float]] = {"ddp": [], "fsdp": []}
    for _ in range(rounds):
        for layout in ("ddp", "fsdp"):
            torch.manual_seed(0)
            trainer = Trainer(
                build_model(ModelSpec(), tokenizer), LossSettings(), OptimizerSettings(), dp, parallelism=layout
            )
            if dp.is_main:
                for i in range(steps_each + 1):
                    t0 = time.perf_counter()
                    trainer.step(inputs, learner_version=0)
                    if i:  # the first step of each block warms up
                        times[layout].append(time.perf_counter() - t0)
                trainer.release_followers()
            else:
                trainer.follow()
            trainer.close()
    if dp.is_main:
        (out / "step_time.json").write_text(json.dumps({"samples_per_step": 128, **times}))
    dp.close()


# -- the driver ---------------------------------------------------------------


def torchrun(
    ranks: int,
    args: list[str],
    env: dict[str, str] | None = None,
    timeout_s: float = 900.0,
    module: str = "benchmarks.learner_memory",
) -> None:
    """``python -m module args`` on ``ranks`` gloo ranks, one thread each; RuntimeError with its output's tail."""
    from services.local import torchrun as launcher

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = launcher.command(ranks, "-m", module, *args)
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def per_rank(runs: dict[str, list[dict[str, Any]]], name: str, key: str) -> float:
    """The largest ``key`` over the ranks of run ``name``."""
    return float(max(r[key] for r in runs[name]))


def memory_figure(runs: dict[str, list[dict[str, Any]]], one: str, two: str, what: str) -> Figure:
    mine, base = per_rank(runs, two, "peak_tensor_bytes"), per_rank(runs, one, "peak_tensor_bytes")
    params = runs[one][0]["num_parameters"]
    return Figure(
        name=f"{FIGURE}{what}",
        value=mine / MB,
        unit="MB",
        ratio=mine / base,
        baseline=f"one rank {base / MB:,.0f} MB",
        measured=f"peak tensor bytes per rank in a step, {params / 1e6:.0f}M-parameter Llama, two FSDP2 ranks",
        targets=TARGETS,
        details={"one_rank": runs[one], "two_ranks": runs[two]},
    )


def rss_figure(runs: dict[str, list[dict[str, Any]]]) -> Figure:
    one, two = ("one-mmap", "fsdp2-meta-mmap") if "fsdp2-meta-mmap" in runs else ("one", "fsdp2")
    mine, base = per_rank(runs, two, "peak_rss_bytes"), per_rank(runs, one, "peak_rss_bytes")
    how = "built on the meta device, mmap threshold 1 MiB (both sides)" if two == "fsdp2-meta-mmap" else "as built"
    return Figure(
        name="learner_peak_rss_fsdp2_2_ranks_vs_1",
        value=mine / MB,
        unit="MB",
        ratio=mine / base,
        baseline=f"one rank {base / MB:,.0f} MB",
        measured=f"peak RSS per rank, two FSDP2 ranks {how}",
        targets=TARGETS,
        details=runs,
    )


def step_time_figure(times: dict[str, Any]) -> Figure:
    fsdp, ddp = statistics.median(times["fsdp"]), statistics.median(times["ddp"])
    return Figure(
        name="learner_step_fsdp2_vs_ddp_2_cpu_ranks",
        value=fsdp,
        unit="s",
        ratio=fsdp / ddp,
        baseline=f"DDP step {ddp * 1e3:.1f} ms",
        measured=f"FSDP2 step of the tiny default model, {times['samples_per_step']} samples, two gloo ranks, "
        f"median of {len(times['fsdp'])}",
        targets=(Target(of="ratio", direction="at least", bound=1.0, rule="auto picks DDP on the CPU"),),
        details=times,
    )


def bench_learner_memory(quick: bool, workdir: Path) -> list[Figure]:
    """Every variant and the step-time run in ``workdir``; the four figures."""
    workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    for v in VARIANTS[:2] if quick else VARIANTS:
        args = ["--worker", v.name, "--workdir", str(workdir), *(["--quick"] if quick else [])]
        torchrun(v.ranks, args, ALLOCATOR_ENV if v.mmap_threshold else None)
        runs[v.name] = [json.loads((workdir / f"{v.name}.rank{r}.json").read_text()) for r in range(v.ranks)]
    rounds = 1 if quick else 4
    torchrun(2, ["--step-time", str(rounds), "--workdir", str(workdir), *(["--quick"] if quick else [])])
    times = json.loads((workdir / "step_time.json").read_text())
    return [
        memory_figure(runs, "one", "fsdp2", ""),
        memory_figure(runs, "one-ac", "fsdp2-ac", "_activation_checkpointing")
        if "fsdp2-ac" in runs
        else not_run(f"{FIGURE}_activation_checkpointing", "MB", TARGETS, "full mode only"),
        rss_figure(runs),
        step_time_figure(times),
    ]


def table(figures: list[Figure]) -> Table:
    t = Table(title="learner sharding")
    for column in ("run", "ranks", "tensor peak MB", "params+grads+AdamW MB", "peak RSS MB", "RSS after", "trimmed"):
        t.add_column(column)
    runs: dict[str, list[dict[str, Any]]] = figures[2].details
    for name, ranks in runs.items():
        worst = max(ranks, key=lambda r: r["peak_tensor_bytes"])
        held = sum(worst["held_bytes"].values())
        t.add_row(
            name,
            str(len(ranks)),
            f"{worst['peak_tensor_bytes'] / MB:,.0f}",
            f"{held / MB:,.0f}",
            f"{max(r['peak_rss_bytes'] for r in ranks) / MB:,.0f}",
            f"{max(r['rss_after_bytes'] for r in ranks) / MB:,.0f}",
            f"{max(r['rss_after_trim_bytes'] for r in ranks) / MB:,.0f}",
        )
    return t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.learner_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help=f"directory for {BENCH_FILE_NAME} and the per-rank records")
    parser.add_argument("--quick", action="store_true", help="a 0.9M-parameter model, without the allocator runs")
    parser.add_argument("--worker", choices=[v.name for v in VARIANTS], help=argparse.SUPPRESS)
    parser.add_argument("--step-time", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(next(v for v in VARIANTS if v.name == args.worker), args.quick, args.workdir)
        return 0
    if args.step_time:
        step_time_worker(args.quick, args.workdir, args.step_time)
        return 0
    if args.output is None:
        parser.error("--output is required")
    figures = bench_learner_memory(args.quick, args.output / "learner_memory")
    Console().print(table(figures))
    write_and_print(figures, args.output / BENCH_FILE_NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
