"""A LoRA learner step's measured peak memory on the CPU against the memory planner's figure for it.

Owns the LoRA memory benchmark. The learner's ``Trainer`` takes two
optimizer steps (AdamW allocates its state in the first) on the 100M test
model (the swap benchmark's Llama, float32), once with a rank-32 adapter
over the frozen base and once as a full fine-tune, on the same batch, in one
process. The measured peak is tensor bytes, as ``benchmarks.learner_memory``
counts them: the storages live before the steps (parameters, buffers, the
batch) plus the largest net total the CPU allocator handed out during the
steps, from the PyTorch profiler's memory events.

The planner's figure is ``services.learner.memory.plan_learner``'s for one
rank in float32 with this batch (its held items without the CUDA reserve, a
GPU's), with the forward and backward counted by ``activation_bytes`` in the
CPU learner's configuration (eager attention, float32, the batch's real
rows, width and completion positions), as tests/learner/test_plan.py checks
the activation figures. Target, as there: the planned peak within 20% of
the measured one, for the LoRA step and for the full fine-tune beside it.

    python -m benchmarks.lora_memory --output DIR [--rank 32]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

from asymptote.lora import LoraSettings
from benchmarks.figure import Figure, Target, write_and_print
from services.learner.activations import ModelShape, activation_bytes
from services.learner.config import LearnerConfig
from services.learner.memory import LEARNER_RESERVE_BYTES, plan_learner

BENCH_FILE_NAME = "lora_memory_bench.json"
RANK = 32
TOLERANCE = 0.2
"""Planned within 20% of measured: the bound the planner's activation figures are held to."""
TARGETS = (
    Target(of="ratio", direction="at least", bound=1 - TOLERANCE),
    Target(of="ratio", direction="at most", bound=1 + TOLERANCE),
)


def planned_peak(
    shape: ModelShape, lora: LoraSettings | None, rows: int, width: int, completions: int
) -> dict[str, int]:
    """The planner's bytes for a CPU learner's step on a batch of ``rows`` x ``width`` tokens with
    ``completions`` completion positions: what it holds throughout, what a forward and backward add, what
    the optimizer step adds, and the peak (held plus the larger of the two)."""
    config = LearnerConfig.model_validate(
        {"model_dir": "unused", "dtype": "float32", "lora": lora, "micro_batch_tokens": rows * width}
    )
    plan = plan_learner(shape, config, gpus_per_node=1, sequence_tokens=width)
    held = sum(i.num_bytes for i in plan.held) - LEARNER_RESERVE_BYTES
    acts = activation_bytes(
        shape,
        tokens=rows * width,
        width_tokens=width,
        completion_positions=completions,
        compute_bytes=4,
        attention="eager",
        fsdp=False,
        checkpointing=False,
    )
    stepping = sum(i.num_bytes for i in plan.stepping)
    return {"held": held, "training": acts.peak, "stepping": stepping, "peak": held + max(acts.peak, stepping)}


def measure_step(model_dir: Path, lora: LoraSettings | None, groups: list[Any]) -> dict[str, Any]:
    """Two optimizer steps of the ``Trainer`` on ``groups``: tensor bytes before them, and their peak."""
    import torch

    from benchmarks.learner_memory import held_bytes, profiled_peak
    from services.learner.config import LossSettings, OptimizerSettings
    from services.learner.model import empty_model, load_tokenizer
    from services.learner.trainer import Trainer, collate

    torch.manual_seed(0)
    trainer = Trainer(
        empty_model(model_dir), LossSettings(), OptimizerSettings(warmup_steps=0), lora=lora, packing=False
    )
    trainer.start(model_dir)
    inputs = collate(groups, int(load_tokenizer(model_dir).pad_token_id))
    before = held_bytes(trainer)
    before["buffers"] = sum(b.untyped_storage().nbytes() for b in trainer.model.buffers())
    before["batch"] = sum(
        t.untyped_storage().nbytes() for t in (inputs.batch.input_ids, inputs.batch.attention_mask, inputs.logp_gen)
    )

    def steps() -> None:
        for _ in range(2):  # AdamW allocates its state in the first
            trainer.step(inputs, learner_version=0)

    started = time.perf_counter()
    peak = sum(before.values()) + profiled_peak(steps)
    rows, width = inputs.batch.input_ids.shape
    record = {
        "peak_tensor_bytes": peak,
        "bytes_before_steps": before,
        "held_bytes": held_bytes(trainer),
        "rows": int(rows),
        "width": int(width),
        "completion_positions": int(inputs.batch.completion_mask.sum()),
        "two_steps_s": time.perf_counter() - started,
    }
    trainer.close()
    return record


def memory_figure(name: str, what: str, measured: dict[str, Any], planned: dict[str, int]) -> Figure:
    got, want = measured["peak_tensor_bytes"], planned["peak"]
    return Figure(
        name=name,
        value=want / 1e6,
        unit="MB",
        ratio=want / got,
        baseline=f"measured peak tensor bytes {got / 1e6:,.1f} MB",
        measured=(
            f"{what}: planned peak {want / 1e6:,.1f} MB (held {planned['held'] / 1e6:,.1f} MB + forward and backward "
            f"{planned['training'] / 1e6:,.1f} MB) for {measured['rows']} rows x {measured['width']} tokens, "
            f"{planned['peak'] / got - 1:+.1%} against the measured peak"
        ),
        targets=TARGETS,
        details={"measured": measured, "planned": planned},
    )


def bench_lora_memory(rank: int = RANK, workdir: Path | None = None) -> list[Figure]:
    """The figures of the module docstring: the LoRA step's and, beside it, the full fine-tune's."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="lora-memory-bench-") as tmp:
            return bench_lora_memory(rank, Path(tmp))
    import torch

    from asymptote.tasks import ALPHABET
    from benchmarks.learner import synthetic_groups
    from benchmarks.transfer import SPEC_100M
    from services.embedded.build import create_model_dir
    from services.learner.model import load_tokenizer

    torch.set_num_threads(1)
    lora = LoraSettings(rank=rank)
    model_dir = create_model_dir(SPEC_100M, ALPHABET, workdir / "model")
    shape = ModelShape.read(model_dir)
    groups = synthetic_groups(len(load_tokenizer(model_dir)), num_prompts=4, group_size=2, prompt_len=16, max_new=48)
    figures = []
    for name, settings in ((f"lora_r{rank}", lora), ("full", None)):
        m = measure_step(model_dir, settings, groups)
        gc.collect()  # the trainer of the step before is gone before the next is built
        planned = planned_peak(shape, settings, m["rows"], m["width"], m["completion_positions"])
        what = f"rank-{rank} LoRA step" if settings else "full fine-tune step"
        figures.append(memory_figure(f"learner_peak_planned_vs_measured_100m_{name}", what, m, planned))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME}")
    parser.add_argument("--rank", type=int, default=RANK, help="the adapter's rank")
    args = parser.parse_args(argv)
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    args.output.mkdir(parents=True, exist_ok=True)
    write_and_print(bench_lora_memory(args.rank), args.output / BENCH_FILE_NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
