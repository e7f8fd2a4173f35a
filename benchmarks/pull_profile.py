"""Where a weight pull's time goes: each stage of the path alone, over the same version's bytes.

Owns the pull's profile. The learner's real weight server
(``benchmarks.transfer.serve_weights``) serves a version on loopback; this
process times each stage alone, interleaved over repeats (medians):

- **learner: frame** the version (``encode_frames``, each frame dropped as it
  is built, as a stream does);
- **wire**: the learner serving the version over gRPC to a client that drops
  each frame as it arrives (framing, gRPC on both sides, loopback);
- **generator: parse** every received frame into its fields and data (what a
  pull does per frame before it writes);
- **generator: write** every chunk's data into a freshly opened staged file
  (``StagingArea``), as the decoder writes it;
- **generator: digest**: BLAKE3 over the version, in the updates the decoder
  makes;
- **generator: NaN/Inf scan** of every tensor;
- **generator: decode alone**: the decoder fed the received frames from
  memory into a staged file (parse, write, digest and scan as a pull runs
  them);
- **generator: commit** the staged folder;
- **the pull**, all of it over gRPC, as ``benchmarks.transfer`` times it;
- **local read** of the version's safetensors file (the transfer's baseline).

Stages overlap in a pull (the digest and scans run beside the receive; the
learner frames in its own process), so the pull takes less than their sum.
Beside each stage's wall time, the CPU time it took (this process's, and
the learner process's for the wire and the pull): on a shared machine the
CPU seconds move less than the wall seconds.

    python -m benchmarks.pull_profile --output DIR [--model 100m] [--repeats 5]

Writes ``pull_profile-MODEL.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from asymptote.codec import (
    HASH_BYTES,
    DecodedWeights,
    Signature,
    WeightsDecoder,
    encode_frames,
    hasher,
    is_finite,
    read_signature,
    signature_num_bytes,
)
from asymptote.contracts.v1 import services_pb2
from asymptote.rpc import channel, reuse_freed_message_buffers
from benchmarks.transfer import MODELS, child_server, model_dir_for, pull_and_stage, read_file, serve_weights
from services.generator.weights import (
    LEARNER_PULL,
    GrpcWeightSource,
    StagingArea,
    parse_part,
)

FRAME, WIRE, PARSE, WRITE, DIGEST, SCAN, DECODE, COMMIT, PULL, READ = STAGES = (
    "learner: frame the version",
    "wire: learner to generator over gRPC, frames dropped",
    "generator: parse frames",
    "generator: write into the staged file",
    "generator: digest (BLAKE3)",
    "generator: NaN/Inf scan",
    "generator: decode alone (parse, write, digest, scan)",
    "generator: commit",
    "the pull, all of it",
    "local read of the same bytes",
)


async def receive(endpoint: str, keep: bool) -> list[bytes]:
    """The served version's frames as a generator receives them (kept only when ``keep``)."""
    frames: list[bytes] = []
    async with channel(endpoint) as ch:
        call = ch.unary_stream(
            LEARNER_PULL,
            request_serializer=services_pb2.PullWeightsRequest.SerializeToString,
            response_deserializer=bytes,
        )
        async for frame in call(services_pb2.PullWeightsRequest(version=1)):
            if keep:
                frames.append(frame)
    return frames


def parse(frames: list[bytes]) -> int:
    """Every frame parsed and its chunk's data taken out, each dropped before the next (as a pull does)."""
    return sum(len(data) for _, data in (parse_part(frame, 1) for frame in frames) if data is not None)


def decode(frames: list[bytes], area: StagingArea, signature: Signature) -> DecodedWeights:
    """The frames through the generator's decoder into a staged file, as a pull feeds it."""
    staged = area.open(1, signature)
    with WeightsDecoder(staged) as decoder:
        for frame in frames:
            decoder.feed(*parse_part(frame, 1))
        weights = decoder.finish()
    staged.discard()
    return weights


def write(frames: list[bytes], area: StagingArea, signature: Signature) -> float:
    """Seconds to copy every chunk's data into a freshly opened staged file (parsed beforehand)."""
    staged = area.open(1, signature)
    chunks = [data for _, data in (parse_part(frame, 1) for frame in frames[1:]) if data is not None]
    started = time.perf_counter()
    buffer = staged.take(signature_num_bytes(signature))
    offset = 0
    for data in chunks:
        buffer[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        offset += len(data)
    elapsed = time.perf_counter() - started
    del buffer
    staged.discard()
    return elapsed


def digest(weights: DecodedWeights) -> str:
    """BLAKE3 over the version in the decoder's updates (``HASH_BYTES`` of a tensor at a time)."""
    h = hasher()
    for name in sorted(weights.tensors):
        data = memoryview(weights.tensors[name].data)
        for offset in range(0, len(data), HASH_BYTES):
            h.update(data[offset : offset + HASH_BYTES])
    return str(h.hexdigest())


async def measure(model: str, workdir: Path, repeats: int) -> dict[str, Any]:
    model_dir = model_dir_for(model, workdir / f"model-{model}")
    signature = read_signature(model_dir)
    file = model_dir / "model.safetensors"
    reuse_freed_message_buffers()
    times: dict[str, list[float]] = {s: [] for s in STAGES}
    cpu: dict[str, list[float]] = {s: [] for s in STAGES}

    def timed(stage: str, run: Callable[[], object]) -> None:
        started, cpu_started = time.perf_counter(), time.process_time()
        run()
        times[stage].append(time.perf_counter() - started)
        cpu[stage].append(time.process_time() - cpu_started)

    async with child_server(serve_weights, (model_dir,), "pull-profile-learner") as (endpoint, served, pid):
        (served_digest,), num_bytes = served
        frames = await receive(endpoint, keep=True)
        area = StagingArea(workdir / "staged")
        held = decode(frames, area, signature)  # the served version, to frame it as the learner does
        source = GrpcWeightSource()
        for i in range(repeats + 1):
            timed(FRAME, lambda: sum(map(len, encode_frames(1, held.tensors, held.digest))))
            started, cpu_started, learner_started = time.perf_counter(), time.process_time(), cpu_seconds(pid)
            await receive(endpoint, keep=False)
            times[WIRE].append(time.perf_counter() - started)
            cpu[WIRE].append(time.process_time() - cpu_started + cpu_seconds(pid) - learner_started)
            timed(PARSE, lambda: parse(frames))
            cpu_started = time.process_time()
            times[WRITE].append(write(frames, area, signature))
            cpu[WRITE].append(time.process_time() - cpu_started)
            timed(DIGEST, lambda: digest(held))
            timed(SCAN, lambda: all(is_finite(t) for t in held.tensors.values()))
            timed(DECODE, lambda: decode(frames, area, signature))
            cpu_started, learner_started = time.process_time(), cpu_seconds(pid)
            pull_s, commit_s = await pull_and_stage(source, endpoint, served_digest, signature, model_dir, area)
            cpu[PULL].append(time.process_time() - cpu_started + cpu_seconds(pid) - learner_started)
            times[COMMIT].append(commit_s)
            times[PULL].append(pull_s + commit_s)
            timed(READ, lambda: read_file(file))
            if i == 0:  # warm-up
                for v in (*times.values(), *cpu.values()):
                    v.clear()
    return {"num_bytes": num_bytes, "wall_s": times, "cpu_s": cpu}


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process ``pid`` has used (all its threads), from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def table(m: dict[str, Any]) -> str:
    """The profile as a markdown table: each stage's median wall ms, MB/s, share of the pull's wall time, CPU ms."""
    num_bytes, wall, cpu = m["num_bytes"], m["wall_s"], m["cpu_s"]
    pull = statistics.median(wall[PULL])
    rows = ["| stage | ms | MB/s | of the pull | CPU ms |", "|---|---|---|---|---|"]
    for stage in STAGES:
        s = statistics.median(wall[stage])
        rate = f"{num_bytes / s / 1e6:,.0f}" if stage != COMMIT else "-"
        used = f"{statistics.median(cpu[stage]) * 1e3:,.0f}" if cpu[stage] else "-"
        rows.append(f"| {stage} | {s * 1e3:,.1f} | {rate} | {s / pull:.2f} | {used} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pull_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="directory for pull_profile-MODEL.json")
    parser.add_argument("--model", choices=sorted(MODELS), default="100m", help="the version pulled")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats of every stage")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats}; accepted: at least 1")
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    args.output.mkdir(parents=True, exist_ok=True)
    m = asyncio.run(measure(args.model, args.output / "pull-profile", args.repeats))
    (args.output / f"pull_profile-{args.model}.json").write_text(json.dumps(m, indent=2) + "\n")
    print(f"{args.model}: {m['num_bytes'] / 1e6:,.1f} MB, medians of {args.repeats}\n{table(m)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
