"""A policy version pulled over gRPC against the same bytes read locally, at the sizes that matter.

Owns the weight-transfer benchmark. The learner's real weight server (a
``WeightStore`` version served by ``LearnerServicer`` through
``asymptote.rpc.start_server``) runs in its own process on loopback. This
process pulls the version as a generator's swapper does before it touches
the engine (``GrpcWeightSource.pull``, which verifies framing, digest and
finiteness, decoding straight into the staged safetensors file of a
``StagingArea``; the digest against the announced one; the tensor
signature; then the staged folder committed), and, interleaved with each
pull, reads the version's safetensors file locally: the baseline, measured
side by side in the same run.

Versions (``MODELS``): the embedded default's model, a Llama of about 100M
float32 parameters (both snapshotted from a real model by the learner's
``WeightStore.snapshot``), and a 1.6 GB bf16 version with the tensor shapes
of Qwen3-1.7B (its embedding and 10 of its 28 layers; random bytes, served
as they are). One relay hop: a generator in a process of its own pulls the
100M version from the learner, holds it and serves it from its staged file
(``WeightRelay``), and this process pulls it from there.

The local read follows the file's write, so it is likely served from the
page cache, which makes the target stricter; a read after asking the kernel
to drop the file's cached pages (``posix_fadvise``) is reported beside it.

    python -m benchmarks.transfer --output DIR [--quick] [--only embedded,100m,1.6gb,relay]

Targets: local read seconds / pull seconds >= 0.5 (``TARGET``) for each
version; through a relay hop >= 0.4 (``RELAY_TARGET``).

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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from asymptote.codec import (
    Signature,
    WireTensor,
    read_signature,
    safetensors_header,
    signature_num_bytes,
    tensor_views,
    version_digest,
)
from asymptote.config import ListenSettings
from asymptote.errors import WeightsError
from asymptote.lora import LoraSettings
from asymptote.nats_local import free_port
from asymptote.tasks import ALPHABET
from benchmarks.figure import Figure, Target, write_and_print
from services.embedded.build import ModelSpec, create_model_dir
from services.generator.weights import RELAY_PULL, GrpcWeightSource, StagingArea, check_signature

TARGET = 0.5
RELAY_TARGET = 0.4
DIGEST_TARGET = 2.0
BENCH_FILE_NAME = "transfer_bench.json"
VERSION = 1
QUICK_SPEC = ModelSpec(hidden_size=256, num_layers=6, num_heads=4, intermediate_size=768)
"""About 5M float32 parameters: 20 MB."""
SPEC_100M = ModelSpec(hidden_size=768, num_layers=14, num_heads=12, intermediate_size=2048, max_position_embeddings=256)
"""A Llama of about 100M float32 parameters (397 MB)."""


@dataclass(frozen=True)
class SyntheticSpec:
    """A bf16 version with a real model's tensor shapes (Qwen3's), random bytes: no model is built."""

    num_layers: int = 10
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151_936

    def signature(self) -> Signature:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        sig: Signature = {
            "model.embed_tokens.weight": ("bfloat16", (self.vocab_size, h)),
            "model.norm.weight": ("bfloat16", (h,)),
        }
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes = {
                "input_layernorm.weight": (h,),
                "post_attention_layernorm.weight": (h,),
                "self_attn.q_proj.weight": (q, h),
                "self_attn.k_proj.weight": (kv, h),
                "self_attn.v_proj.weight": (kv, h),
                "self_attn.o_proj.weight": (h, q),
                "self_attn.q_norm.weight": (self.head_dim,),
                "self_attn.k_norm.weight": (self.head_dim,),
                "mlp.gate_proj.weight": (self.intermediate_size, h),
                "mlp.up_proj.weight": (self.intermediate_size, h),
                "mlp.down_proj.weight": (h, self.intermediate_size),
            }
            sig.update({p + name: ("bfloat16", shape) for name, shape in shapes.items()})
        return sig


MODELS: dict[str, ModelSpec | SyntheticSpec] = {
    "quick": QUICK_SPEC,
    "embedded": ModelSpec(),
    "100m": SPEC_100M,
    "1.6gb": SyntheticSpec(),
}
"""The versions the benchmark pulls; ``quick`` is the CI run's."""
FULL_RUN = ("embedded", "100m", "1.6gb", "relay")
QUICK_RUN = ("quick", "relay")
RELAY_MODEL = {"quick": "quick", "full": "100m"}
"""The version a relay hop carries in each mode."""
REPEATS = {"quick": 3, "embedded": 15, "100m": 7, "1.6gb": 3}


def create_synthetic_dir(spec: SyntheticSpec, out_dir: Path) -> Path:
    """A folder holding ``spec``'s version as ``model.safetensors`` (random bf16 words, finite) and a config."""
    out_dir.mkdir(parents=True, exist_ok=True)
    signature = spec.signature()
    header = safetensors_header(signature, {"format": "pt"})
    rng = np.random.default_rng(0)
    with (out_dir / "model.safetensors").open("wb") as f:
        f.write(header)
        for name in sorted(signature):
            n = math.prod(signature[name][1])
            # Normal float32 values' top halves: finite bf16 words.
            f.write((rng.standard_normal(n, dtype=np.float32).view("<u4") >> 16).astype("<u2").tobytes())
    (out_dir / "config.json").write_text(json.dumps({"synthetic": True, "num_layers": spec.num_layers}) + "\n")
    return out_dir


def model_dir_for(model: str, out_dir: Path) -> Path:
    """The folder of ``model``'s version (built once: reused when ``out_dir`` holds it already)."""
    if (out_dir / "model.safetensors").exists():
        return out_dir
    spec = MODELS[model]
    if isinstance(spec, SyntheticSpec):
        return create_synthetic_dir(spec, out_dir)
    return create_model_dir(spec, ALPHABET, out_dir)


def is_synthetic(model_dir: Path) -> bool:
    return bool(json.loads((model_dir / "config.json").read_text()).get("synthetic"))


def file_tensors(model_dir: Path) -> dict[str, WireTensor]:
    """The tensors of ``model_dir``'s safetensors file, in memory, as it stores them."""
    signature = read_signature(model_dir)
    path = model_dir / "model.safetensors"
    with path.open("rb") as f:
        header_len = 8 + int.from_bytes(f.read(8), "little")
    buffer = np.fromfile(path, dtype=np.uint8, offset=header_len)
    return tensor_views(buffer[: signature_num_bytes(signature)], signature)


def adapter_versions(model_dir: Path, lora: LoraSettings, versions: int) -> tuple[Signature, list[list[Any]]]:
    """``versions`` adapters as a LoRA learner serves them over the base in ``model_dir`` (the ``Trainer``'s
    own ``served_tensors``), with their signature: the first a nonzero adapter, each after it a step away
    from the one before in every tensor."""
    import torch

    from services.learner.config import LossSettings, OptimizerSettings
    from services.learner.model import empty_model
    from services.learner.trainer import Trainer

    trainer = Trainer(empty_model(model_dir), LossSettings(), OptimizerSettings(), lora=lora, packing=False)
    trainer.start(model_dir)
    signature = trainer.served_signature()
    assert signature is not None
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    adapters = []
    for version in range(versions):
        with torch.no_grad():  # B starts at zero: the first version is made nonzero, as after some steps
            for p in trained:
                p.add_(torch.randn(p.shape, generator=generator) * (1e-2 if version == 0 else 1e-4))
        adapters.append([(name, t.clone()) for name, t in trainer.served_tensors(list(signature))])
    trainer.close()
    return signature, adapters


def serve_weights(
    model_dir: Path, port: int, conn: Connection, versions: int = 1, lora: LoraSettings | None = None
) -> None:
    """The learner's weight server in a child process: snapshot, serve, report, wait for the word to stop.

    Holds versions 1..``versions``; each after the first differs from the one
    before in every tensor, as after an optimizer step. Sends the versions'
    digests and the bytes of one version once it serves. A synthetic
    version (``create_synthetic_dir``) is served as its file holds it, once.
    With ``lora`` each version is the adapter a LoRA learner (the ``Trainer``
    over the base in ``model_dir``) serves, nonzero from the first.
    """
    import torch
    from transformers.utils.logging import disable_progress_bar

    from asymptote.health import Health
    from asymptote.rpc import start_server
    from services.learner.model import load_model
    from services.learner.server import LearnerServicer, add_learner_to_server
    from services.learner.weights import Version, WeightStore

    torch.set_num_threads(1)
    disable_progress_bar()

    async def run() -> None:
        store = WeightStore(read_signature(model_dir), keep=versions)
        served = []
        if lora is not None:
            signature, adapters = adapter_versions(model_dir, lora, versions)
            store = WeightStore(signature, keep=versions)
            served = [store.snapshot_tensors(version, tensors) for version, tensors in enumerate(adapters, start=1)]
        elif is_synthetic(model_dir):
            tensors = file_tensors(model_dir)
            served.append(store.put(Version(1, tensors, version_digest(tensors))))
        else:
            model = load_model(model_dir)
            generator = torch.Generator().manual_seed(0)
            for version in range(1, versions + 1):
                if version > 1:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(torch.randn(p.shape, generator=generator) * 1e-4)
                served.append(store.snapshot(version, model))
            del model
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


def serve_relay(learner: str, model_dir: Path, staging: Path, port: int, conn: Connection) -> None:
    """A generator one hop below the learner, in a child process: pull the version, hold it, serve it.

    Pulls and verifies as a swapper does, hands the relay the verified
    version viewing its staged file, serves ``WeightRelay.PullWeights``;
    sends the seconds its own pull took once it serves.
    """
    from asymptote.health import Health
    from asymptote.rpc import start_server
    from services.generator.fanout import WeightRelay, add_relay_to_server

    async def run() -> None:
        relay = WeightRelay()
        area = StagingArea(staging, on_overwrite=relay.retire)
        signature = read_signature(model_dir)
        started = time.perf_counter()
        staged = area.open(VERSION, signature)
        weights = await GrpcWeightSource().pull(learner, VERSION, into=staged)
        check_signature(weights, signature)
        staged.commit(model_dir, weights.digest)
        pulled_s = time.perf_counter() - started
        relay.hold(weights)
        server, _ = await start_server(
            ListenSettings(host="127.0.0.1", port=port),
            Health("generator"),
            lambda s: add_relay_to_server(relay, s),
            [],
        )
        conn.send(pulled_s)
        try:
            await asyncio.to_thread(conn.recv)
        except EOFError:
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


@asynccontextmanager
async def child_server(target: Any, args: tuple[Any, ...], name: str, timeout_s: float = 300.0) -> AsyncIterator[Any]:
    """``target(*args, port, conn)`` in a spawned child; yields (endpoint, what it sent once serving, its pid)."""
    port = free_port()
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    server = context.Process(target=target, args=(*args, port, child), name=name, daemon=True)
    server.start()
    try:
        if not await asyncio.to_thread(wait_for_server, parent, server, timeout_s):
            raise RuntimeError(f"{name} did not start within {timeout_s:.0f} s (exit code {server.exitcode})")
        yield f"127.0.0.1:{port}", parent.recv(), server.pid
    finally:
        parent.send("stop")
        server.join(15)
        if server.is_alive():
            server.kill()
            server.join(5)


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


async def measure(model_dir: Path, workdir: Path, repeats: int, relay: bool = False) -> dict[str, Any]:
    """Interleaved pulls (from the learner, or through a relay hop) and local reads of ``model_dir``'s version."""
    async with child_server(serve_weights, (model_dir,), "transfer-bench-learner") as (learner, served, _):
        (digest,), num_bytes = served
        endpoint, source, relay_pull_s = learner, GrpcWeightSource(), None
        async with _maybe_relay(relay, learner, model_dir, workdir) as hop:
            if hop is not None:
                (endpoint, relay_pull_s, _), source = hop, GrpcWeightSource(method=RELAY_PULL)
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
        "relay_pull_s": relay_pull_s,
    }


@asynccontextmanager
async def _maybe_relay(relay: bool, learner: str, model_dir: Path, workdir: Path) -> AsyncIterator[Any]:
    if not relay:
        yield None
        return
    async with child_server(serve_relay, (learner, model_dir, workdir / "relay-staged"), "transfer-bench-relay") as hop:
        yield hop


def transfer_figure(model: str, m: dict[str, Any], num_parameters: int, relay: bool) -> Figure:
    """One version's figure from ``measure``'s record: medians, the ratio local read seconds / pull seconds."""
    repeats = len(m["pull_s"])
    pull = statistics.median(p + s for p, s in zip(m["pull_s"], m["stage_s"]))
    read = statistics.median(m["read_s"])
    cold = statistics.median(m["cold_read_s"])
    mb = m["num_bytes"] / 1e6
    where = "from a generator one relay hop below the learner" if relay else "from the learner"
    details: dict[str, Any] = {
        "model": model,
        "bytes": m["num_bytes"],
        "file_bytes": m["file_bytes"],
        "num_parameters": num_parameters,
        "repeats": repeats,
        "pull_mb_per_s": mb / pull,
        "read_mb_per_s": m["file_bytes"] / 1e6 / read,
        "cold_read_mb_per_s": m["file_bytes"] / 1e6 / cold,
        "pull_verify_s": statistics.median(m["pull_s"]),
        "stage_s": statistics.median(m["stage_s"]),
        "disk_read_s": read,
        "disk_cold_read_s": cold,
        "ratio_vs_cold_read": cold / pull,
        "pull_s_each": [p + s for p, s in zip(m["pull_s"], m["stage_s"])],
        "disk_read_s_each": m["read_s"],
    }
    if relay:
        # The relay holds a version once its own pull is verified, then serves it: a version reaches
        # the generator below after both pulls, one after the other.
        details["relay_own_pull_s"] = m["relay_pull_s"]
        details["through_hop_s"] = m["relay_pull_s"] + pull
        details["ratio_through_hop"] = read / (m["relay_pull_s"] + pull)
    return Figure(
        name="weight_transfer_relay_hop_vs_disk" if relay else f"weight_transfer_grpc_vs_disk{FIGURE_SUFFIX[model]}",
        value=pull,
        unit="s",
        ratio=read / pull,
        baseline=(
            f"local read {m['file_bytes'] / 1e6 / read:,.0f} MB/s (safetensors file, likely page-cache warm; "
            f"after evicting its pages {m['file_bytes'] / 1e6 / cold:,.0f} MB/s)"
        ),
        measured=(
            f"gRPC pull {where} {mb / pull:,.0f} MB/s ({mb:,.1f} MB in {pull * 1e3:,.0f} ms: pull and verify "
            f"{statistics.median(m['pull_s']) * 1e3:,.0f} ms, staging {statistics.median(m['stage_s']) * 1e3:.0f} ms; "
            f"median of {repeats})"
        ),
        targets=(Target(of="ratio", direction="at least", bound=RELAY_TARGET if relay else TARGET),),
        details=details,
    )


FIGURE_SUFFIX = {"quick": "", "100m": "", "embedded": "_embedded", "1.6gb": "_1_6gb"}
"""The headline figure (no suffix) is the quick run's version, and the 100M model's in a full run."""


def bench_transfer(
    quick: bool = False, workdir: Path | None = None, only: tuple[str, ...] | None = None
) -> list[Figure]:
    """The weight transfer's figures (see the module docstring): a pull's seconds against a local read.

    Medians over interleaved repeats. The pull is timed through staging (as
    the swapper's pull time is); pull-and-verify and staging are also given
    apart in the details. ``quick``: a 20 MB model, direct and through a
    relay hop, 3 repeats each; ``only``: the parts of the run to do
    (``FULL_RUN``'s names).
    """
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="transfer-bench-") as tmp:
            return bench_transfer(quick, Path(tmp), only)
    workdir.mkdir(parents=True, exist_ok=True)
    parts = QUICK_RUN if quick else (only or FULL_RUN)
    figures = []
    for part in parts:
        relay = part == "relay"
        model = RELAY_MODEL["quick" if quick else "full"] if relay else part
        model_dir = model_dir_for(model, workdir / f"model-{model}")
        num_parameters = sum(math.prod(shape) for _, shape in read_signature(model_dir).values())
        repeats = REPEATS[model]
        m = asyncio.run(measure(model_dir, workdir / part, repeats, relay))
        figures.append(transfer_figure(model, m, num_parameters, relay))
    return figures


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


QWEN3_8B_BYTES = 8.19e9 * 2
"""Qwen3-8B's parameters in bf16."""
DELTA_FRACTION = 0.016
"""The bytes of a delta version against a whole one after a step at lr 5e-7 (benchmarks.fanout's measure)."""


def projection(
    figures: list[Figure],
    full_bytes: float = QWEN3_8B_BYTES,
    delta_fraction: float = DELTA_FRACTION,
    fleet: int = 256,
    degree: int = 4,
) -> dict[str, float]:
    """Seconds a Qwen3-8B version (whole, and as a delta) takes at the measured rates, one hop and through the tree.

    The rate of the largest version pulled from the learner, and the relay
    hop's; a relay serves a version once it holds it, so a version reaches
    depth d after d pulls one after another (the learner's, then d - 1 hops).
    """
    direct = max(
        (f for f in figures if f.details.get("model") and "relay_own_pull_s" not in f.details),
        key=lambda f: f.details["bytes"],
    )
    hop = next((f for f in figures if "relay_own_pull_s" in f.details), None)
    direct_bps = direct.details["pull_mb_per_s"] * 1e6
    hop_bps = hop.details["pull_mb_per_s"] * 1e6 if hop is not None else direct_bps
    depth = tree_depth(fleet, degree)
    out = {
        "fleet": fleet,
        "degree": degree,
        "depth": depth,
        "direct_mb_per_s": direct_bps / 1e6,
        "hop_mb_per_s": hop_bps / 1e6,
    }
    for kind, num_bytes in (("full", full_bytes), ("delta", full_bytes * delta_fraction)):
        out[f"{kind}_bytes"] = num_bytes
        out[f"{kind}_one_hop_s"] = num_bytes / direct_bps
        out[f"{kind}_tree_s"] = num_bytes / direct_bps + (depth - 1) * num_bytes / hop_bps
    return out


def tree_depth(fleet: int, degree: int) -> int:
    """Pulls, one after another, until the last of ``fleet`` generators in a degree-``degree`` tree holds a version."""
    from services.generator.fanout import ancestors

    return 1 + max(len(ancestors(i, degree)) for i in range(fleet))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME}")
    parser.add_argument("--quick", action="store_true", help="a 20 MB model and fewer repeats (for CI)")
    parser.add_argument(
        "--only",
        type=lambda s: tuple(s.split(",")),
        help=f"parts of the full run, comma-separated: {','.join(FULL_RUN)}",
    )
    args = parser.parse_args(argv)
    if args.only is not None and (not args.only or set(args.only) - set(FULL_RUN)):
        parser.error(f"--only: {','.join(args.only)}; accepted: any of {','.join(FULL_RUN)}")
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    args.output.mkdir(parents=True, exist_ok=True)
    figures = bench_transfer(args.quick, args.output / "transfer-bench", args.only)
    write_and_print(figures, args.output / BENCH_FILE_NAME)
    if any(f.details.get("bytes", 0) > 1e9 for f in figures) or any("relay_own_pull_s" in f.details for f in figures):
        p = projection(figures)
        (args.output / "transfer_projection.json").write_text(json.dumps(p, indent=2) + "\n")
        print(
            f"Qwen3-8B ({p['full_bytes'] / 1e9:.1f} GB bf16): whole {p['full_one_hop_s']:.1f} s one hop, "
            f"{p['full_tree_s']:.1f} s through a degree-{p['degree']} tree of {p['fleet']} (depth {p['depth']}); "
            f"delta ({p['delta_bytes'] / 1e6:.0f} MB) {p['delta_one_hop_s']:.2f} s, {p['delta_tree_s']:.2f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
