"""In-flight (PipelineRL-k) against synchronous RL on the same local stack.

Owns the pipeline benchmark: one invocation runs the local stack for the
same number of learner steps in ``async`` mode (k = 8, in-flight weight
swaps) and in ``sync`` mode (generators drain before every swap, the
learner trains only on its current version), with the generator and the
learner pinned to separate cores, and reports the ratio of trained samples
per second. It also reports the generator's pause per swap (each swap's
stall, from the generator's log) against the time to copy the model's
bytes once in memory, measured in the same run.

    python -m benchmarks.pipeline --output bench-out [--steps 60]

Targets: samples/s ratio >= 1.5; median pause <= 2 x copy + 20 ms.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.figure import Figure, Target
from services.local.config import StackConfig
from services.local.progress import read_jsonl
from services.local.stack import LocalStack

RATIO_TARGET = 1.5
PAUSE_SLACK_S = 0.020
PIPELINE_TARGETS = (Target(of="ratio", direction="at least", bound=RATIO_TARGET),)
BENCH_FILE_NAME = "pipeline_bench.json"
PAUSE_RE = re.compile(r"loaded version \d+: .* paused ([\d.]+) ms(?: \(loading ([\d.]+) ms)?")


def trained_samples_per_s(run_dir: Path) -> float:
    """Samples trained per second between the first and the last learner step."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if len(rows) < 2:
        raise RuntimeError(f"{run_dir}: fewer than two learner steps")
    first, last = rows[0], rows[-1]
    return (last["samples_trained"] - first["samples_trained"]) / (last["unix_s"] - first["unix_s"])


def swap_pauses_s(run_dir: Path, part: int = 1) -> list[float]:
    """The run's swap pauses from its generators' logs (``part`` 2: the load inside each, where logged)."""
    pauses: list[float] = []
    for log in sorted((run_dir / "logs").glob("generator-*.log")):
        found = PAUSE_RE.finditer(log.read_text(errors="replace"))
        pauses += [float(m.group(part)) / 1e3 for m in found if m.group(part) is not None]
    return pauses


def copy_time_s(model_dir: Path, repeats: int = 50) -> tuple[float, int]:
    """Median time to copy the model's bytes once in memory, and the byte count."""
    import torch
    from safetensors.torch import load_file

    tensors = [t.contiguous() for f in sorted(model_dir.glob("*.safetensors")) for t in load_file(str(f)).values()]
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    dst = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), num_bytes


def pipeline_figure(inflight_dir: Path, sync_dir: Path) -> Figure:
    """Trained samples/s of the in-flight run against the synchronous run."""
    inflight, sync = trained_samples_per_s(inflight_dir), trained_samples_per_s(sync_dir)
    return Figure(
        name="pipeline_samples_per_s_inflight_vs_sync",
        value=inflight,
        unit="samples/s",
        ratio=inflight / sync,
        baseline=f"synchronous {sync:.1f} samples/s",
        measured=f"in-flight k=8 {inflight:.1f} samples/s ({len(read_jsonl(inflight_dir / 'metrics.jsonl'))} steps)",
        targets=PIPELINE_TARGETS,
    )


def swap_figure(run_dir: Path, model_dir: Path) -> Figure:
    """The median pause of the run's weight swaps against one in-memory copy of the model's bytes."""
    pauses = swap_pauses_s(run_dir)
    if not pauses:
        raise RuntimeError(f"{run_dir}: no weight swap was logged")
    copy_s, num_bytes = copy_time_s(model_dir)
    median = statistics.median(pauses)
    p90 = statistics.quantiles(pauses, n=10)[-1] if len(pauses) >= 2 else pauses[0]
    loads = swap_pauses_s(run_dir, part=2)
    loading = f", loading into the model {statistics.median(loads) * 1e3:.1f} ms of it" if loads else ""
    return Figure(
        name="swap_pause_median_vs_memory_copy",
        value=median,
        unit="s",
        baseline=f"copy of {num_bytes:,} bytes in memory {copy_s * 1e3:.3f} ms",
        measured=f"median of {len(pauses)} swaps {median * 1e3:.1f} ms (p90 {p90 * 1e3:.1f} ms{loading})",
        targets=(Target(of="value", direction="at most", bound=2 * copy_s + PAUSE_SLACK_S, rule="2 x copy + 20 ms"),),
        details={
            "pauses_s": pauses,
            "loads_s": loads,
            "copy_s": copy_s,
            "model_bytes": num_bytes,
            "median_over_copy": median / copy_s,
        },
    )


THROUGHPUT_WORKLOAD = "arithmetic"
"""The stack runs that measure rates (pipeline, generator, swaps, scaling) use the arithmetic workload:
equal four-token completions, so rates compare across settings and with earlier figures; the
learning-speed figure runs the embedded default."""


def run_mode(out: Path, mode: str, steps: int, base: dict[str, Any]) -> tuple[Path, Path]:
    config = StackConfig.model_validate(
        {**base, "run_dir": out / mode, "mode": mode, "max_steps": steps, "eval_every_versions": steps}
    )
    stack = LocalStack(config)
    code = stack.run()
    if code != 0:
        raise RuntimeError(f"{mode} run failed (exit {code}); see {stack.run_dir / 'logs'}")
    return stack.run_dir, model_dir_of(stack.run_dir)


def model_dir_of(run_dir: Path) -> Path:
    """The model directory a local-stack run's learner started from."""
    import yaml

    return Path(yaml.safe_load((run_dir / "config" / "learner.yaml").read_text())["model_dir"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for the runs and {BENCH_FILE_NAME}")
    parser.add_argument("--steps", type=int, default=60, help="learner steps per mode")
    parser.add_argument("--batch-prompts", type=int, default=32)
    args = parser.parse_args(argv)
    out = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = {"batch_prompts": args.batch_prompts, "pin_cores": True, "workload": THROUGHPUT_WORKLOAD}
    runs = {mode: run_mode(out, mode, args.steps, base) for mode in ("async", "sync")}
    figures = [pipeline_figure(runs["async"][0], runs["sync"][0]), swap_figure(*runs["async"])]
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "steps_per_mode": args.steps,
        "batch_prompts": args.batch_prompts,
        "figures": [f.as_json() for f in figures],
    }
    (out / BENCH_FILE_NAME).write_text(json.dumps(result, indent=2) + "\n")
    for f in figures:
        print(f"{f.name}: {f.measured}; baseline {f.baseline}; target {f.target}: {f.verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
