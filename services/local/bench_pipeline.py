"""In-flight (PipelineRL-k) against synchronous RL on the same local stack.

Owns the pipeline benchmark: one invocation runs the local stack for the
same number of learner steps in ``async`` mode (k = 8, in-flight weight
swaps) and in ``sync`` mode (generators drain before every swap, the
learner trains only on its current version), with the generator and the
learner pinned to separate cores, and reports the ratio of trained samples
per second. It also reports the generator's pause per swap (each swap's
stall, from the generator's log) against the time to copy the model's
bytes once in memory, measured in the same run.

    python -m services.local.bench_pipeline --output bench-out [--steps 60]

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

from services.local.config import StackConfig
from services.local.progress import read_jsonl
from services.local.stack import LocalStack

RATIO_TARGET = 1.5
PAUSE_SLACK_S = 0.020
PAUSE_RE = re.compile(r"loaded version \d+: .* paused ([\d.]+) ms")


def trained_samples_per_s(run_dir: Path) -> float:
    """Samples trained per second between the first and the last learner step."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if len(rows) < 2:
        raise RuntimeError(f"{run_dir}: fewer than two learner steps")
    first, last = rows[0], rows[-1]
    return (last["samples_trained"] - first["samples_trained"]) / (last["unix_s"] - first["unix_s"])


def swap_pauses_s(run_dir: Path) -> list[float]:
    pauses: list[float] = []
    for log in sorted((run_dir / "logs").glob("generator-*.log")):
        pauses += [float(m.group(1)) / 1e3 for m in PAUSE_RE.finditer(log.read_text(errors="replace"))]
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


def run_mode(out: Path, mode: str, steps: int, base: dict[str, Any]) -> tuple[Path, Path]:
    config = StackConfig.model_validate(
        {**base, "run_dir": out / mode, "mode": mode, "max_steps": steps, "eval_every_versions": steps}
    )
    stack = LocalStack(config)
    code = stack.run()
    if code != 0:
        raise RuntimeError(f"{mode} run failed (exit {code}); see {stack.run_dir / 'logs'}")
    return stack.run_dir, _model_dir(stack.run_dir)


def _model_dir(run_dir: Path) -> Path:
    import yaml

    return Path(yaml.safe_load((run_dir / "config" / "learner.yaml").read_text())["model_dir"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.local.bench_pipeline", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--output", type=Path, required=True, help="directory for the runs and pipeline_bench.json")
    parser.add_argument("--steps", type=int, default=60, help="learner steps per mode")
    parser.add_argument("--batch-prompts", type=int, default=32)
    args = parser.parse_args(argv)
    out = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = {"batch_prompts": args.batch_prompts, "pin_cores": True}

    runs = {mode: run_mode(out, mode, args.steps, base) for mode in ("async", "sync")}
    rates = {mode: trained_samples_per_s(run_dir) for mode, (run_dir, _) in runs.items()}
    pauses = swap_pauses_s(runs["async"][0])
    copy_s, num_bytes = copy_time_s(runs["async"][1])
    ratio = rates["async"] / rates["sync"]
    median_pause = statistics.median(pauses) if pauses else float("nan")
    pause_bound = 2 * copy_s + PAUSE_SLACK_S
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "steps_per_mode": args.steps,
        "batch_prompts": args.batch_prompts,
        "figures": [
            {
                "name": "pipeline_samples_per_s_inflight_vs_sync",
                "ratio": ratio,
                "baseline": f"sync {rates['sync']:.1f} samples/s",
                "measured": f"in-flight k=8 {rates['async']:.1f} samples/s",
                "target": f">= {RATIO_TARGET}",
                "passed": ratio >= RATIO_TARGET,
            },
            {
                "name": "swap_pause_median_vs_memory_copy",
                "seconds": median_pause,
                "baseline": f"copy of {num_bytes} bytes: {copy_s * 1e3:.3f} ms",
                "measured": f"median of {len(pauses)} swaps; p90 {statistics.quantiles(pauses, n=10)[-1] * 1e3:.1f} ms"
                if len(pauses) >= 2
                else "too few swaps",
                "target": f"<= 2 x copy + 20 ms = {pause_bound * 1e3:.1f} ms",
                "passed": median_pause <= pause_bound,
            },
        ],
    }
    (out / "pipeline_bench.json").write_text(json.dumps(result, indent=2))
    for fig in result["figures"]:
        value = f"{fig['ratio']:.2f}x" if "ratio" in fig else f"{fig['seconds'] * 1e3:.1f} ms"
        print(
            f"{fig['name']}: {value}  ({fig['measured']}; baseline {fig['baseline']}; target {fig['target']}; "
            f"{'PASS' if fig['passed'] else 'FAIL'})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
