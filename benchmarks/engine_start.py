"""A CPU engine's start and sampling with its model in a forked engine core, against vLLM's worker process.

Owns the engine-start benchmark. The generator's ``Engine`` runs the model
in vLLM's engine-core process on a CPU (``worker_in_engine_core``: vLLM's
``uni`` executor, as on one GPU) and forks that process from its own
(``engine_core_start_method``), as vLLM does on a GPU; vLLM's CPU build by
default spawns the engine core and gives the model a worker process of its
own, and each imports vLLM and torch once more. This starts the embedded
default's model three ways, in turn (``--rounds`` each): the generator's
way, its model in a spawned engine core (the fork's share, in the details),
and vLLM's CPU default; each start in a fresh Python process as a
generator's start is (its imports included). It measures the wall time
from that process's start to the engine being ready, the tokens per second
of one batch of sampling (16 prompts x 8 samples x 32 tokens, the batch
taken twice and the second timed), and the CPU time of the whole process
tree (``getrusage`` of the reaped children: start, sampling and shutdown).

Targets: the CPU time at most 0.85x vLLM's default's, and
sampling at least 0.95x as fast (the hop the worker process adds is not
bought back elsewhere). It writes ``DIR/engine_start_bench.json``.

    python -m benchmarks.engine_start --output DIR [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.figure import Figure, Target, write_and_print

BENCH_FILE_NAME = "engine_start_bench.json"
ROUNDS = 2
PROMPTS, SAMPLES, TOKENS = 16, 8, 32


KINDS = ("in_core", "in_core_spawned", "worker_process")
"""The generator's engine; its model in a spawned engine core; vLLM's CPU default (the baseline)."""


async def one_start(model_dir: Path, kind: str, born: float) -> dict[str, float]:
    """Start an engine of ``kind`` (KINDS), sample, stop."""
    from services.generator import engine as engine_module
    from services.generator.config import EngineSettings

    if kind != "in_core":  # vLLM's start method
        engine_module.engine_core_start_method = lambda s: None  # type: ignore[assignment]
    if kind == "worker_process":  # vLLM's CPU default, for the baseline
        engine_module.worker_in_engine_core = lambda s: False  # type: ignore[assignment]
    engine = engine_module.Engine(EngineSettings(model_dir=model_dir, max_num_seqs=64, kv_cache_memory_bytes=64 << 20))
    await engine.start()
    start_s = time.time() - born
    try:
        prompt = [1, 2, 3, 4, 5, 6]
        for _ in range(2):  # the first batch warms the engine's buffers; the second is timed
            t0 = time.monotonic()
            outs = await asyncio.gather(
                *(engine.sample(prompt, SAMPLES, 1.0, 1.0, TOKENS, seed=i) for i in range(PROMPTS))
            )
            sampled_s = time.monotonic() - t0
        tokens = sum(len(s.token_ids) for _, samples in outs for s in samples)
    finally:
        await engine.shutdown()
    return {"start_s": start_s, "tokens_per_s": tokens / sampled_s}


def measured_start(model_dir: Path, kind: str) -> dict[str, float]:
    """One start of ``kind`` in a fresh process; its figures and the CPU seconds of its process tree."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.engine_start",
            "--one",
            kind,
            "--model",
            str(model_dir),
            "--born",
            repr(time.time()),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind"),  # the same placement both ways
    )
    if out.returncode != 0:
        raise RuntimeError(f"the {kind} start failed: {out.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "cpu_s": cpu_s}


def bench_engine_start(rounds: int = ROUNDS, workdir: Path | None = None) -> list[Figure]:
    """The figures of the module docstring."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="engine-start-bench-") as tmp:
            return bench_engine_start(rounds, Path(tmp))
    from asymptote.tasks import ALPHABET
    from services.embedded.build import ModelSpec, create_model_dir

    model_dir = create_model_dir(ModelSpec(), ALPHABET, workdir / "model")
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for _ in range(rounds):  # in turn, so the machine's drift meets each
        for kind in runs:
            runs[kind].append(measured_start(model_dir, kind))

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    cpu = {kind: median(kind, "cpu_s") for kind in runs}
    wall = {kind: median(kind, "start_s") for kind in runs}
    rate = {kind: median(kind, "tokens_per_s") for kind in runs}
    details: dict[str, Any] = {
        "runs": runs,
        "rounds": rounds,
        "cpu_s": cpu,
        "ready_s": wall,
        "cpu_forked_vs_spawned_core": cpu["in_core"] / cpu["in_core_spawned"],
    }
    return [
        Figure(
            name="engine_start_cpu_in_core_vs_worker_process",
            value=cpu["in_core"],
            unit="CPU-s",
            ratio=cpu["in_core"] / cpu["worker_process"],
            baseline=(
                f"a spawned engine core and a worker process of its own (vLLM's CPU default) "
                f"{cpu['worker_process']:.1f} CPU-s"
            ),
            measured=(
                f"the model in a forked engine core {cpu['in_core']:.1f} CPU-s (a fresh process: imports, "
                f"start, sampling, shutdown; {cpu['in_core_spawned']:.1f} with the core spawned); ready "
                f"{wall['in_core']:.1f} s after the process began against {wall['worker_process']:.1f} s "
                f"({wall['in_core_spawned']:.1f} spawned); median of {rounds}, in turn"
            ),
            targets=(Target(of="ratio", direction="at most", bound=0.85),),
            details=details,
        ),
        Figure(
            name="engine_tokens_per_s_in_core_vs_worker_process",
            value=rate["in_core"],
            unit="tokens/s",
            ratio=rate["in_core"] / rate["worker_process"],
            baseline=f"a worker process of its own {rate['worker_process']:,.0f} tokens/s",
            measured=(
                f"the model in a forked engine core {rate['in_core']:,.0f} tokens/s ({PROMPTS} prompts x {SAMPLES} "
                f"samples x {TOKENS} tokens); median of {rounds}"
            ),
            targets=(Target(of="ratio", direction="at least", bound=0.95),),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_start", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help=f"directory for {BENCH_FILE_NAME} (required)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="starts of each kind, alternately")
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--born", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:  # one start, in this fresh process (``measured_start``)
        print(json.dumps(asyncio.run(one_start(args.model, args.one, args.born))))
        return 0
    if args.output is None:
        parser.error("the following arguments are required: --output")
    args.output.mkdir(parents=True, exist_ok=True)
    write_and_print(bench_engine_start(args.rounds), args.output / BENCH_FILE_NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
