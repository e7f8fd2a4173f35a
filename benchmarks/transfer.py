"""A policy version pulled over gRPC against the same bytes read from local disk.

Owns the weight-transfer benchmark. The learner's real weight server (a
``WeightStore`` snapshot served by ``LearnerServicer`` through
``asymptote.rpc.start_server``) runs in its own process on loopback, serving
a model larger than the embedded default's so fixed costs do not dominate.
This process pulls the version as a generator's swapper does before it
touches the engine (``GrpcWeightSource.pull``, which verifies framing,
digest and finiteness, decoding straight into the staged safetensors file
of a ``StagingArea``; the digest against the announced one; the tensor
signature; then the staged folder committed), and, interleaved with
each pull, reads the model's safetensors file from local disk. It runs both
sides of the transfer, the learner's and the generator's.

The disk read follows the file's write, so it is likely served from the page
cache, which makes the target stricter; a read after asking the kernel to
drop the file's cached pages (``posix_fadvise``) is reported beside it.

    python -m benchmarks.transfer --output DIR [--quick]

Target: disk read time / pull time >= 0.5 (the pull at least half as fast).

A second figure, ``bench_digest``: the version digest (BLAKE3, ``asymptote.codec.version_digest``)
against the sha256 it replaced over the same tensors, interleaved. Target: sha256 seconds / digest
seconds >= 2 (``DIGEST_TARGET``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import multiprocessing
import os
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from asymptote.codec import Signature, WireTensor, read_signature, version_digest
from asymptote.config import ListenSettings
from asymptote.errors import WeightsError
from asymptote.nats_local import free_port
from asymptote.tasks import ALPHABET
from benchmarks.figure import Figure, Target
from services.embedded.build import ModelSpec, create_model_dir
from services.generator.weights import GrpcWeightSource, StagingArea, check_signature

TARGET = 0.5
DIGEST_TARGET = 2.0
BENCH_FILE_NAME = "transfer_bench.json"
VERSION = 1
FULL_SPEC = ModelSpec(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=1536)
"""About 20M float32 parameters: 82 MB."""
QUICK_SPEC = ModelSpec(hidden_size=256, num_layers=6, num_heads=4, intermediate_size=768)
"""About 5M float32 parameters: 20 MB."""


def serve_weights(model_dir: Path, port: int, conn: Connection, versions: int = 1) -> None:
    """The learner's weight server in a child process: snapshot, serve, report, wait for the word to stop.

    Holds versions 1..``versions``; each after the first differs from the one
    before in every tensor, as after an optimizer step. Sends the versions'
    digest digests and the bytes of one version once it serves.
    """
    import torch
    from transformers.utils.logging import disable_progress_bar

    from asymptote.health import Health
    from asymptote.rpc import start_server
    from services.learner.model import load_model
    from services.learner.server import LearnerServicer, add_learner_to_server
    from services.learner.weights import WeightStore

    torch.set_num_threads(1)
    disable_progress_bar()

    async def run() -> None:
        model = load_model(model_dir)
        store = WeightStore(read_signature(model_dir), keep=versions)
        generator = torch.Generator().manual_seed(0)
        served = []
        for version in range(1, versions + 1):
            if version > 1:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=generator) * 1e-4)
            served.append(store.snapshot(version, model))
        health = Health("learner")
        servicer = LearnerServicer(store, health, "bench", lambda: {})
        server, _ = await start_server(
            ListenSettings(port=port),
            health,
            lambda s: add_learner_to_server(servicer, s),
            ["asymptote.contracts.v1.Learner"],
        )
        conn.send(([v.digest for v in served], served[0].num_bytes))
        try:
            await asyncio.to_thread(conn.recv)
        except EOFError:  # the parent went away
            pass
        await server.stop(grace=1.0)

    asyncio.run(run())


def wait_for_server(conn: Connection, server: multiprocessing.process.BaseProcess, timeout_s: float) -> bool:
    """Whether the server reported ready within ``timeout_s``; False as soon as its process is gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            return True
        if not server.is_alive():
            return conn.poll()
    return False


async def pull_and_stage(
    source: GrpcWeightSource, endpoint: str, digest: str, signature: Signature, model_dir: Path, area: StagingArea
) -> tuple[float, float]:
    """One pull as the swapper does it; (pull-and-verify seconds, staging seconds)."""
    started = time.perf_counter()
    staged = area.open(VERSION, signature)
    weights = await source.pull(endpoint, VERSION, into=staged)  # decoded straight into the staged file
    if weights.digest != digest:
        raise WeightsError(f"version {VERSION}: digest {weights.digest[:12]} differs from the served {digest[:12]}")
    check_signature(weights, signature)
    pulled = time.perf_counter()
    folder = staged.commit(model_dir)
    committed = time.perf_counter()
    del weights
    # The swapper keeps the loaded version's file as the next pull's buffer
    # after the swap, outside its pull time.
    area.recycle(folder)
    return pulled - started, committed - pulled


def read_file(path: Path, drop_cache: bool = False) -> float:
    """Seconds to read ``path`` into memory; ``drop_cache`` first asks the kernel to evict its pages."""
    if drop_cache:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    started = time.perf_counter()
    with path.open("rb", buffering=0) as f:
        data = f.read()
    elapsed = time.perf_counter() - started
    assert len(data) == path.stat().st_size
    return elapsed


async def measure(model_dir: Path, workdir: Path, repeats: int) -> dict[str, Any]:
    port = free_port()
    parent, child = multiprocessing.get_context("spawn").Pipe()
    server = multiprocessing.get_context("spawn").Process(
        target=serve_weights, args=(model_dir, port, child), name="transfer-bench-learner", daemon=True
    )
    server.start()
    try:
        if not await asyncio.to_thread(wait_for_server, parent, server, 120.0):
            raise RuntimeError(f"the weight server did not start within 120 s (exit code {server.exitcode})")
        (digest,), num_bytes = parent.recv()
        endpoint = f"127.0.0.1:{port}"
        source = GrpcWeightSource()
        signature = read_signature(model_dir)
        file = model_dir / "model.safetensors"
        os.sync()  # written pages are clean, so the cold read's eviction can take them
        area = StagingArea(workdir / "staged")
        await pull_and_stage(source, endpoint, digest, signature, model_dir, area)  # warm-up
        read_file(file)
        pull_s, stage_s, read_s, cold_s = [], [], [], []
        for _ in range(repeats):
            p, s = await pull_and_stage(source, endpoint, digest, signature, model_dir, area)
            pull_s.append(p)
            stage_s.append(s)
            read_s.append(read_file(file))
            cold_s.append(read_file(file, drop_cache=True))
        return {
            "num_bytes": num_bytes,
            "file_bytes": file.stat().st_size,
            "pull_s": pull_s,
            "stage_s": stage_s,
            "read_s": read_s,
            "cold_read_s": cold_s,
        }
    finally:
        parent.send("stop")
        server.join(15)
        if server.is_alive():
            server.kill()
            server.join(5)


def bench_transfer(quick: bool = False, workdir: Path | None = None) -> Figure:
    """The weight transfer's figure (see the module docstring): seconds of a pull, against a disk read.

    Medians over interleaved repeats. The pull is timed through staging (as
    the swapper's pull time is); pull-and-verify and staging are also given
    apart in the details. The ratio is disk read seconds / pull seconds.
    ``quick``: a 20 MB model and 3 repeats instead of 82 MB and 7.
    """
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="transfer-bench-") as tmp:
            return bench_transfer(quick, Path(tmp))
    workdir.mkdir(parents=True, exist_ok=True)
    spec, repeats = (QUICK_SPEC, 3) if quick else (FULL_SPEC, 7)
    model_dir = create_model_dir(spec, ALPHABET, workdir / "model")
    num_parameters = sum(math.prod(shape) for _, shape in read_signature(model_dir).values())
    m = asyncio.run(measure(model_dir, workdir, repeats))
    pull = statistics.median(p + s for p, s in zip(m["pull_s"], m["stage_s"]))
    read = statistics.median(m["read_s"])
    cold = statistics.median(m["cold_read_s"])
    mb = m["num_bytes"] / 1e6
    return Figure(
        name="weight_transfer_grpc_vs_disk",
        value=pull,
        unit="s",
        ratio=read / pull,
        baseline=(
            f"local disk read {m['file_bytes'] / 1e6 / read:,.0f} MB/s (safetensors file, likely page-cache warm; "
            f"after evicting its pages {m['file_bytes'] / 1e6 / cold:,.0f} MB/s)"
        ),
        measured=(
            f"gRPC pull {mb / pull:,.0f} MB/s ({mb:.1f} MB in {pull * 1e3:.0f} ms: pull and verify "
            f"{statistics.median(m['pull_s']) * 1e3:.0f} ms, staging {statistics.median(m['stage_s']) * 1e3:.0f} ms; "
            f"median of {repeats})"
        ),
        targets=(Target(of="ratio", direction="at least", bound=TARGET),),
        details={
            "bytes": m["num_bytes"],
            "file_bytes": m["file_bytes"],
            "num_parameters": num_parameters,
            "repeats": repeats,
            "pull_verify_s": statistics.median(m["pull_s"]),
            "stage_s": statistics.median(m["stage_s"]),
            "disk_read_s": read,
            "disk_cold_read_s": cold,
            "ratio_vs_cold_read": cold / pull,
            "pull_s_each": [p + s for p, s in zip(m["pull_s"], m["stage_s"])],
            "disk_read_s_each": m["read_s"],
        },
    )


def bench_digest(quick: bool = False) -> Figure:
    """Seconds to digest a version (64 tensors; 512 MB, quick 64 MB), BLAKE3 against sha256, interleaved."""
    total, repeats = (64 << 20, 3) if quick else (512 << 20, 5)
    rng = np.random.default_rng(0)
    tensors = {
        f"layer.{i:02d}.weight": WireTensor("float32", (total // 64 // 4,), rng.bytes(total // 64)) for i in range(64)
    }
    blake, sha = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        version_digest(tensors)
        t1 = time.perf_counter()
        version_digest(tensors, hashlib.sha256)
        t2 = time.perf_counter()
        blake.append(t1 - t0)
        sha.append(t2 - t1)
    b, h = statistics.median(blake[1:]), statistics.median(sha[1:])
    return Figure(
        name="weights_digest_blake3_vs_sha256",
        value=b,
        unit="s",
        ratio=h / b,
        baseline=f"sha256 {total / h / 1e9:.2f} GB/s",
        measured=f"BLAKE3 {total / b / 1e9:.2f} GB/s ({total / 1e6:.0f} MB, median of {repeats})",
        targets=(Target(of="ratio", direction="at least", bound=DIGEST_TARGET),),
        details={"bytes": total, "blake3_s": b, "sha256_s": h, "cores": os.cpu_count(), "repeats": repeats},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME}")
    parser.add_argument("--quick", action="store_true", help="a 20 MB model and fewer repeats (for CI)")
    args = parser.parse_args(argv)
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    args.output.mkdir(parents=True, exist_ok=True)
    figure = bench_transfer(args.quick, args.output / "transfer-bench")
    (args.output / BENCH_FILE_NAME).write_text(json.dumps(figure.as_json(), indent=2) + "\n")
    print(
        f"weight transfer: {figure.measured} vs {figure.baseline} = {figure.ratio:.3f} "
        f"(target {figure.target}; {figure.verdict})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
