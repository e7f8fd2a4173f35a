"""A generator's weight swap against a real engine: peak extra memory, pull and pause.

Owns the swap benchmark. The learner's real weight server (a ``WeightStore``
holding several versions, served by ``LearnerServicer``) runs in its own
process on loopback. This process runs a real vLLM engine under light
generation load and a ``Swapper`` that pulls, verifies, stages and loads
each version exactly as a generator does. While the swaps run, a sampler
thread reads every 2 ms the anonymous memory of this process and of the
engine's processes (``RssAnon`` in ``/proc``) and the pages the staging
folder holds on tmpfs (pages a process maps from there are counted once,
as the folder's). The figures, each against a baseline measured in the
same run:

  peak extra memory of a swap / the model's bytes                    <= 1.1
      with swap_prepack (the CPU engine's default)                   <= 2.1
  median pull (verified and staged) vs a local read of the same bytes  >= 0.5
  median pause vs one in-memory copy of the model's bytes           <= 2x + 20 ms

"Extra" is measured against the generator before its first swap: the
staging folder then holds nothing and the engine holds the model once.
With swap_prepack the worker builds the next version's packed weights while
the old ones serve, one more copy of the model by design; ``--no-prepack``
loads in the pause instead, the memory GPU generators (which pack nothing)
are sized by.

    python -m benchmarks.swap --output DIR [--model embedded|100m] [--swaps N] [--no-prepack]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from asymptote.codec import read_signature, signature_num_bytes
from asymptote.contracts.v1 import rollout_pb2
from asymptote.lora import LoraSettings
from asymptote.nats_local import free_port
from asymptote.tasks import ALPHABET
from benchmarks.figure import Figure, Target
from benchmarks.pipeline import PAUSE_SLACK_S, copy_time_s
from benchmarks.transfer import SPEC_100M, read_file, serve_weights, wait_for_server
from services.embedded.build import ModelSpec, create_model_dir
from services.generator.engine import Engine, SwapReport

MEMORY_TARGET = 1.1
PREPACK_MEMORY_TARGET = MEMORY_TARGET + 1.0
"""With swap_prepack: the staged version, and the packed copy of it the worker builds before the swap."""
TRANSFER_TARGET = 0.5
BENCH_FILE_NAME = "swap_bench.json"
SAMPLE_EVERY_S = 0.002
MODELS: dict[str, ModelSpec] = {
    "embedded": ModelSpec(),
    "100m": SPEC_100M,
}
"""The embedded default's model, and a Llama of about 100M float32 parameters (400 MB)."""
ModelName = Literal["embedded", "100m"]


def _rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f"{f.read().strip()} ({pid})"
    except OSError:
        return str(pid)


def _tmpfs_bytes(folder: Path) -> int:
    """Bytes of pages the folder's files hold (allocated blocks, not apparent sizes)."""
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.stat().st_blocks * 512
        except OSError:
            pass
    return total


class MemorySampler:
    """Samples ``extra()`` on a thread; ``peak`` is its maximum since ``start``."""

    def __init__(self, pids: Callable[[], list[int]], staging: Path) -> None:
        self.pids = pids
        self.staging = staging
        self.baseline_anon = 0
        self.peak = 0
        self.peak_staged = 0
        self.baseline_by_pid: dict[int, int] = {}
        self.peak_by_pid: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def anon(self) -> int:
        total = 0
        for pid in self.pids():
            rss = _rss_anon(pid)
            total += rss
            if self._thread.is_alive():
                delta = rss - self.baseline_by_pid.get(pid, 0)
                self.peak_by_pid[pid] = max(self.peak_by_pid.get(pid, 0), delta)
            else:
                self.baseline_by_pid[pid] = rss
        return total

    def extra(self) -> tuple[int, int]:
        staged = _tmpfs_bytes(self.staging)
        return self.anon() - self.baseline_anon + staged, staged

    def start(self) -> None:
        self.baseline_anon = self.anon()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            extra, staged = self.extra()
            if extra > self.peak:
                self.peak, self.peak_staged = extra, staged
            time.sleep(SAMPLE_EVERY_S)  # pacing: the sampling period


class RecordingEngine:
    """The engine as the swapper's target, keeping each swap's report."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.version = engine.version
        self.reports: list[SwapReport] = []

    async def swap(self, weights_path: Path, version: int, mode: Literal["inflight", "drain"]) -> SwapReport:
        report = await self.engine.swap(weights_path, version, mode)
        self.version = self.engine.version
        self.reports.append(report)
        return report


async def measure(
    model_dir: Path, staging_root: Path, swaps: int, prepack: bool = True, lora: LoraSettings | None = None
) -> dict[str, Any]:
    """``swaps`` swaps under generation load, each a version the learner's weight server holds; with ``lora``
    a LoRA run's, every version an adapter loaded in place (a first one loaded before the measured swaps, as
    the engine samples nothing without one)."""
    import psutil

    from services.generator.config import EngineSettings
    from services.generator.metrics import GeneratorMetrics
    from services.generator.swapper import Swapper
    from services.generator.weights import GrpcWeightSource

    port = free_port()
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    first = 1 if lora is None else 2
    versions = swaps + first - 1
    server = context.Process(target=serve_weights, args=(model_dir, port, child, versions, lora), daemon=True)
    server.start()
    engine = Engine(
        EngineSettings(model_dir=model_dir, max_num_seqs=16, kv_cache_memory_bytes=64 << 20, swap_prepack=prepack),
        lora,
    )
    try:
        if not await asyncio.to_thread(wait_for_server, parent, server, 300.0):
            raise RuntimeError(f"the weight server did not start within 300 s (exit code {server.exitcode})")
        digests, version_bytes = parent.recv()
        await engine.start()
        me = psutil.Process()

        def generator_pids() -> list[int]:
            return [me.pid] + [p.pid for p in me.children(recursive=True) if p.pid != server.pid]

        metrics = GeneratorMetrics()
        staging = staging_root / "staged"
        target = RecordingEngine(engine)
        swapper = Swapper(target, GrpcWeightSource(), model_dir, staging, "inflight", metrics, lora=lora)

        async def update(version: int) -> None:
            policy = rollout_pb2.PolicyVersion(
                version=version, weights_endpoint=f"127.0.0.1:{port}", digest=digests[version - 1]
            )
            if not await swapper.update(policy):
                raise RuntimeError(f"version {version} was refused: {swapper.refused.get(version)}")

        stop_load = asyncio.Event()

        async def load() -> None:  # sequences in flight at every swap
            i = 0
            while not stop_load.is_set():
                await engine.sample("12+34=", 4, 1.0, 1.0, 48, seed=i)
                i += 1

        if lora is not None:
            await update(1)
        await engine.sample("1+1=", 1, 1.0, 1.0, 4, seed=0)  # warm
        sampler = MemorySampler(generator_pids, staging)
        sampler.start()
        loader = asyncio.create_task(load())
        pulls, pauses, loads, peaks = [], [], [], []
        try:
            for version in range(first, versions + 1):
                before, loaded = metrics.swap_pull_s._sum.get(), metrics.swap_load_s._sum.get()
                await update(version)
                pulls.append(metrics.swap_pull_s._sum.get() - before)
                pauses.append(metrics.swap_last_pause_s._value.get())
                loads.append(metrics.swap_load_s._sum.get() - loaded)
                peaks.append(sampler.peak)
        finally:
            stop_load.set()
            await loader
            sampler.stop()
        file = next(model_dir.glob("*.safetensors"))
        reads = [read_file(file) for _ in range(5)]
        return {
            "model_bytes": signature_num_bytes(read_signature(model_dir)),
            "version_bytes": version_bytes,
            "adapter_versions_loaded": metrics.adapter_versions._value.get(),
            "carried": [r.num_running for r in target.reports[first - 1 :]],
            "peak_extra_bytes": sampler.peak,
            "peak_staged_bytes": sampler.peak_staged,
            "peak_after_each_swap": peaks,
            "peak_anon_by_process": {
                _process_name(pid): sampler.peak_by_pid.get(pid, 0) for pid in sampler.baseline_by_pid
            },
            "pull_s": pulls,
            "pause_s": pauses,
            "load_s": loads,
            "staged_s": [r.staged_s for r in target.reports[first - 1 :]],
            "prepare_s": [r.prepare_s for r in target.reports[first - 1 :]],
            "prepacked": [r.prepacked for r in target.reports[first - 1 :]],
            "read_s": reads,
            "file_bytes": file.stat().st_size,
        }
    finally:
        await engine.shutdown()
        parent.send("stop")
        server.join(15)
        if server.is_alive():
            server.kill()


def bench_swap(
    model: ModelName = "embedded", swaps: int = 4, workdir: Path | None = None, prepack: bool = True
) -> list[Figure]:
    """The swap's figures (see the module docstring) for ``model``."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="swap-bench-") as tmp:
            return bench_swap(model, swaps, Path(tmp), prepack)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = MODELS[model]
    model_dir = create_model_dir(spec, ALPHABET, workdir / "model")
    num_parameters = sum(math.prod(shape) for _, shape in read_signature(model_dir).values())
    with tempfile.TemporaryDirectory(prefix="swap-bench-", dir=_tmpfs_root()) as staging_root:
        m = asyncio.run(measure(model_dir, Path(staging_root), swaps, prepack))
    model_bytes = m["model_bytes"]
    ratio = m["peak_extra_bytes"] / model_bytes
    copy_s, _ = copy_time_s(model_dir, repeats=20)
    pull, read, pause = statistics.median(m["pull_s"]), statistics.median(m["read_s"]), statistics.median(m["pause_s"])
    mb = model_bytes / 1e6
    label = f"{model} model ({num_parameters / 1e6:.1f}M parameters, {mb:.1f} MB)" + (
        ", prepacked while generating" if prepack else ", loaded in the pause"
    )
    details = {"model": model, "num_parameters": num_parameters, "prepack": prepack, **m, "copy_s": copy_s}
    return [
        Figure(
            name=f"swap_peak_extra_memory_{model}",
            value=ratio,
            unit="x",
            ratio=ratio,
            baseline=f"the model's bytes, {mb:.1f} MB",
            measured=(
                f"{label}: peak extra {m['peak_extra_bytes'] / 1e6:.1f} MB over {swaps} swaps "
                f"(tmpfs {m['peak_staged_bytes'] / 1e6:.1f} MB at the peak; RAM the rest)"
            ),
            targets=(
                Target(of="ratio", direction="at most", bound=PREPACK_MEMORY_TARGET if prepack else MEMORY_TARGET),
            ),
            details=details,
        ),
        Figure(
            name=f"swap_pull_vs_disk_read_{model}",
            value=pull,
            unit="s",
            ratio=read / pull,
            baseline=f"local read of the safetensors file {m['file_bytes'] / 1e6 / read:,.0f} MB/s",
            measured=f"{label}: pull, verify and stage {mb / pull:,.0f} MB/s (median of {swaps})",
            targets=(Target(of="ratio", direction="at least", bound=TRANSFER_TARGET),),
        ),
        Figure(
            name=f"swap_pause_vs_memory_copy_{model}",
            value=pause,
            unit="s",
            baseline=f"copy of {model_bytes:,} bytes in memory {copy_s * 1e3:.1f} ms",
            measured=(
                f"{label}: median pause {pause * 1e3:.1f} ms over {swaps} swaps under generation load "
                f"(loading into the model {statistics.median(m['load_s']) * 1e3:.1f} ms of it"
                + (
                    f"; packed beforehand, while generating, in {statistics.median(m['prepare_s']) * 1e3:.0f} ms)"
                    if all(m["prepacked"])
                    else ")"
                )
            ),
            targets=(
                Target(of="value", direction="at most", bound=2 * copy_s + PAUSE_SLACK_S, rule="2 x copy + 20 ms"),
            ),
        ),
    ]


def _tmpfs_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.swap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME}")
    parser.add_argument("--model", choices=sorted(MODELS), default="embedded")
    parser.add_argument("--swaps", type=int, default=4)
    parser.add_argument(
        "--no-prepack", dest="prepack", action="store_false", help="load in the pause (swap_prepack off)"
    )
    args = parser.parse_args(argv)
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    args.output.mkdir(parents=True, exist_ok=True)
    figures = bench_swap(args.model, args.swaps, prepack=args.prepack)
    path = args.output / BENCH_FILE_NAME.replace(".json", f"-{args.model}.json")
    path.write_text(json.dumps([f.as_json() for f in figures], indent=2) + "\n")
    for f in figures:
        print(f"{f.name}: {f.measured} vs {f.baseline} (target {f.target}; {f.verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
