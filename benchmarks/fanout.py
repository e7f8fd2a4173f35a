"""Weight fan-out at fleet scale: deltas and the generator tree, simulated in one process.

Owns the fan-out benchmark. The learner's real weight server
(``LearnerServicer`` over a ``WeightStore``) serves versions of a ~10M
parameter Llama in bf16 (the served dtype), taken after real AdamW steps
on a real next-token loss (arithmetic text), so the fraction of bf16
elements that change per step is a measured one. N simulated generators
run the generator's own weight path: each has a ``Swapper`` (pull with its
held base, verify against the announced digest, stage on tmpfs, hand the
relay the verified version, recycle), a ``WeightRelay`` on its own gRPC
server, and a ``PeerWeightSource`` (tree) or ``GrpcWeightSource`` (every
generator from the learner); only vLLM is replaced, by a stand-in that
records the version it was handed. Every node's egress goes through a
simulated link of ``--link-mb-per-s`` (frames leave one after another at
that rate), since all nodes share this machine's loopback and cores.

Per fleet size (1, 16, 64, 256) and mode (star or tree, whole versions or
deltas) it reports the time until every generator holds each version, the
learner's egress per version, and the bytes per version with and without
deltas. In the tree runs it injects failures on one version: an interior
generator dies mid-transfer (its server stops while it sends) and another
serves corrupted bytes; afterwards every live generator's staged bytes must
hash to the learner's digest.

    python -m benchmarks.fanout --output DIR [--quick]

Writes ``fanout_bench.json``, ``bench.md`` and ``scaling-weights.png`` into DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import os
import random
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import grpc
import numpy as np

from asymptote.codec import BufferSource, DecodedWeights, Signature, read_signature, tensor_views, version_digest
from asymptote.config import ListenSettings
from asymptote.contracts.v1 import rollout_pb2, services_pb2
from asymptote.delta import DeltaStats, delta_frames
from asymptote.health import Health
from asymptote.rpc import start_server
from asymptote.tasks import ALPHABET
from benchmarks.figure import Figure, Target
from services.embedded.build import ModelSpec
from services.generator.engine import SwapReport
from services.generator.fanout import PeerWeightSource, WeightRelay, add_relay_to_server, ancestors
from services.generator.metrics import PULL_KINDS, GeneratorMetrics
from services.generator.swapper import Swapper
from services.generator.weights import GrpcWeightSource, HeldVersion, WeightSource
from services.learner.server import LearnerServicer, add_learner_to_server
from services.learner.weights import Version, WeightStore

log = logging.getLogger(__name__)

BENCH_FILE_NAME = "fanout_bench.json"
FULL_SPEC = ModelSpec(hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1024, max_position_embeddings=64)
"""About 10.6M parameters: 21 MB per version in bf16."""
QUICK_SPEC = ModelSpec(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256)
FLEETS = (1, 16, 64, 256)
QUICK_FLEETS = (1, 8)
DEGREE = 4
QUICK_DEGREE = 2
PAPER_LR = 5e-7
"""ScaleRL's learning rate for its 8B model: what the fan-out runs train with."""
TINY_LR = 1e-4
"""This project's default (a tiny model's learning rate): deltas measured at it too."""
Mode = Literal["star-full", "star-delta", "tree-full", "tree-delta"]
MODES: tuple[Mode, ...] = ("star-full", "star-delta", "tree-full", "tree-delta")


# -- real learner steps ------------------------------------------------------------------


def learner_versions(model_dir: Path, lr: float, num_versions: int, seed: int = 0) -> list[Version]:
    """``num_versions`` served versions of ``model_dir``'s model, one AdamW step apart on a next-token loss."""
    import torch

    from services.learner.config import OptimizerSettings
    from services.learner.model import load_model, load_tokenizer

    torch.manual_seed(seed)
    model = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    store = WeightStore(read_signature(model_dir), keep=num_versions)
    opt_settings = OptimizerSettings(lr=lr)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=lr,
        betas=opt_settings.betas,
        eps=opt_settings.eps,
        weight_decay=opt_settings.weight_decay,
    )
    rng = random.Random(seed)
    versions = [store.snapshot(1, model)]
    for version in range(2, num_versions + 1):
        lines = [f"{a}+{b}={a + b}" for a, b in ((rng.randrange(1000), rng.randrange(1000)) for _ in range(32))]
        rows = [tokenizer(line)["input_ids"][:16] for line in lines]
        pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        ids = torch.tensor([row + [pad] * (16 - len(row)) for row in rows])
        labels = torch.where(ids == pad, -100, ids)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_settings.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        versions.append(store.snapshot(version, model))
    return versions


def delta_sizes(versions: list[Version]) -> list[dict[str, Any]]:
    """Each version's delta from the one before: changed elements and bytes by encoding."""
    rows = []
    for base, target in itertools.pairwise(versions):
        stats = DeltaStats()
        frames = delta_frames(
            target.version, target.tensors, target.digest, base.version, base.tensors, base.digest, stats
        )
        rows.append(
            {
                "version": target.version,
                "changed_fraction": stats.changed_fraction,
                "num_changed": stats.num_changed,
                "num_elements": stats.num_elements,
                "delta_bytes": sum(map(len, frames)),
                "full_bytes": target.num_bytes,
                "bytes_by_encoding": stats.bytes_by_encoding,
                "windows_by_encoding": stats.windows_by_encoding,
            }
        )
    return rows


# -- the simulated fleet -----------------------------------------------------------------


class Link:
    """A node's egress: frames leave one after another at ``bytes_per_s`` (None: as fast as they come)."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0
        self.sent = 0

    async def send(self, num_bytes: int) -> None:
        self.sent += num_bytes
        if self.bytes_per_s is None:
            return
        now = time.monotonic()
        self.free_at = max(self.free_at, now) + num_bytes / self.bytes_per_s
        await asyncio.sleep(self.free_at - now)


class LinkedLearner(LearnerServicer):
    """The learner's real PullWeights, its frames sent through a ``Link``."""

    def __init__(self, store: WeightStore, link: Link) -> None:
        super().__init__(store, Health("learner"), "bench", dict)
        self.link = link

    async def PullWeights(
        self, request: services_pb2.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for frame in super().PullWeights(request, context):
            await self.link.send(len(frame))
            yield frame


@dataclass
class Fault:
    """What a relay does wrong on one version: die after some frames, or flip a byte of every stream."""

    version: int
    kind: Literal["dies", "corrupts"]
    after_frames: int = 3


class SimRelay(WeightRelay):
    """A generator's real relay, through its ``Link``, with an optional ``Fault``."""

    def __init__(self, metrics: GeneratorMetrics, link: Link) -> None:
        super().__init__(metrics)
        self.link = link
        self.fault: Fault | None = None
        self.on_death: asyncio.Event = asyncio.Event()

    async def PullWeights(
        self, request: services_pb2.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        fault = self.fault if self.fault is not None and self.fault.version == request.version else None
        sent = 0
        async for frame in super().PullWeights(request, context):
            if fault is not None and sent == fault.after_frames:
                if fault.kind == "dies":
                    self.on_death.set()  # the fleet stops this generator's server, ending this stream
                    await asyncio.sleep(3600)  # pacing: cancelled when the server stops
                elif len(frame) > 64:
                    frame = frame[:-1] + bytes([frame[-1] ^ 0x20])
            await self.link.send(len(frame))
            sent += 1
            yield frame


class StandInEngine:
    """vLLM's stand-in: a swap records the version (the weight path is what is measured)."""

    def __init__(self) -> None:
        self.version = 0

    async def swap(self, weights_path: Path, version: int, mode: Literal["inflight", "drain"]) -> SwapReport:
        self.version = version
        return SwapReport(version, 0.0, 0)


class WholeVersions:
    """A source that never asks for a delta: the baseline without deltas."""

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner

    async def pull(
        self, endpoint: str, version: int, into: BufferSource | None = None, base: HeldVersion | None = None
    ) -> DecodedWeights:
        return await self.inner.pull(endpoint, version, into, None)


@dataclass
class SimGenerator:
    index: int
    engine: StandInEngine
    swapper: Swapper
    relay: SimRelay
    metrics: GeneratorMetrics
    server: grpc.aio.Server
    endpoint: str
    alive: bool = True


def pulled_bytes(m: GeneratorMetrics) -> dict[str, float]:
    return {kind: m.weight_pull_bytes.labels(kind)._value.get() for kind in PULL_KINDS}


def pull_counts(m: GeneratorMetrics) -> dict[str, float]:
    return {kind: m.weight_pulls.labels(kind)._value.get() for kind in PULL_KINDS}


def staged_digest(g: SimGenerator, signature: Signature) -> str | None:
    """The digest of the bytes this generator's staging area would load: read back from the file."""
    area = g.swapper.staging
    files = [p for p in area.root.rglob("*.safetensors")]
    if len(files) != 1:
        return None
    raw = np.fromfile(files[0], dtype=np.uint8)
    header_len = int.from_bytes(raw[:8].tobytes(), "little")
    return version_digest(tensor_views(raw[8 + header_len :], signature))


@dataclass
class Fleet:
    signature: Signature
    model_dir: Path
    root: Path
    store: WeightStore
    learner_link: Link
    learner_server: grpc.aio.Server
    learner_endpoint: str
    generators: list[SimGenerator] = field(default_factory=list)

    async def stop(self) -> None:
        for g in self.generators:
            await g.server.stop(None)
        await self.learner_server.stop(None)


async def start_fleet(
    model_dir: Path, root: Path, num_generators: int, degree: int, deltas: bool, link_bytes_per_s: float | None
) -> Fleet:
    signature = read_signature(model_dir)
    store = WeightStore(signature, keep=2)
    link = Link(link_bytes_per_s)
    learner = LinkedLearner(store, link)
    server, port = await start_server(
        ListenSettings(host="127.0.0.1", port=0),
        Health("learner"),
        lambda s: add_learner_to_server(learner, s),
        [],
    )
    fleet = Fleet(signature, model_dir, root, store, link, server, f"127.0.0.1:{port}")
    for index in range(num_generators):
        metrics = GeneratorMetrics()
        relay = SimRelay(metrics, Link(link_bytes_per_s))
        g_server, g_port = await start_server(
            ListenSettings(host="127.0.0.1", port=0), Health("generator"), partial(add_relay_to_server, relay), []
        )
        peers = [fleet.generators[i].endpoint for i in ancestors(index, degree)] if degree else []
        source: WeightSource = (
            PeerWeightSource(peers, peer_timeout_s=20.0, metrics=metrics)
            if degree
            else GrpcWeightSource(metrics=metrics)
        )
        if not deltas:
            source = WholeVersions(source)
        engine = StandInEngine()
        swapper = Swapper(engine, source, model_dir, root / f"g{index}", "inflight", metrics, relay)
        fleet.generators.append(SimGenerator(index, engine, swapper, relay, metrics, g_server, f"127.0.0.1:{g_port}"))
    return fleet


async def update_until_held(g: SimGenerator, policy: rollout_pb2.PolicyVersion, attempts: int = 5) -> bool:
    """The swapper's update, retried as the swap loop would (a generator that died stops)."""
    for _ in range(attempts):
        if not g.alive:
            return False
        if await g.swapper.update(policy):
            return True
        await asyncio.sleep(0.2)  # pacing: the swap loop's retry after an unreachable source
    return False


async def watch_for_death(fleet: Fleet, g: SimGenerator) -> None:
    await g.relay.on_death.wait()
    g.alive = False
    await g.server.stop(None)


async def distribute(fleet: Fleet, v: Version) -> dict[str, Any]:
    """Announce ``v`` to every live generator; time until all hold it, and the bytes it took."""
    fleet.store.put(v)
    live = [g for g in fleet.generators if g.alive]
    before_egress = fleet.learner_link.sent
    before_bytes = [pulled_bytes(g.metrics) for g in live]
    before_counts = [pull_counts(g.metrics) for g in live]
    before_peer_failures = sum(g.metrics.weight_peer_failures._value.get() for g in live)
    policy = rollout_pb2.PolicyVersion(
        version=v.version, weights_endpoint=fleet.learner_endpoint, digest=v.digest, num_bytes=v.num_bytes
    )
    started = time.monotonic()
    held = await asyncio.gather(*(update_until_held(g, policy) for g in live))
    elapsed = time.monotonic() - started
    received: dict[str, float] = {kind: 0.0 for kind in PULL_KINDS}
    counts: dict[str, float] = {kind: 0.0 for kind in PULL_KINDS}
    for g, b0, c0 in zip(live, before_bytes, before_counts):
        for kind, x in pulled_bytes(g.metrics).items():
            received[kind] += x - b0[kind]
        for kind, x in pull_counts(g.metrics).items():
            counts[kind] += x - c0[kind]
    survivors = [g for g in live if g.alive]
    return {
        "version": v.version,
        "time_s": elapsed,
        "learner_egress_bytes": fleet.learner_link.sent - before_egress,
        "received_bytes": sum(received.values()),
        "received_bytes_by_kind": received,
        "pulls_by_kind": counts,
        "peer_failures": sum(g.metrics.weight_peer_failures._value.get() for g in live) - before_peer_failures,
        "num_live": len(survivors),
        "num_held": sum(1 for g, ok in zip(live, held) if ok and g.alive),
        "num_died": len(live) - len(survivors),
    }


async def run_fleet(
    model_dir: Path,
    root: Path,
    versions: list[Version],
    num_generators: int,
    mode: Mode,
    link_bytes_per_s: float | None,
    tree_degree: int,
    faults: dict[int, Fault] | None = None,
) -> dict[str, Any]:
    """One fleet through every version; the per-version rows and the final digest check."""
    degree = tree_degree if mode.startswith("tree") else 0
    fleet = await start_fleet(model_dir, root, num_generators, degree, mode.endswith("delta"), link_bytes_per_s)
    watchers = []
    try:
        for index, fault in (faults or {}).items():
            g = fleet.generators[index]
            g.relay.fault = fault
            if fault.kind == "dies":
                watchers.append(asyncio.create_task(watch_for_death(fleet, g)))
        rows = [await distribute(fleet, v) for v in versions]
        newest = versions[-1]
        wrong = [
            g.index
            for g in fleet.generators
            if g.alive and (g.engine.version != newest.version or staged_digest(g, fleet.signature) != newest.digest)
        ]
        return {
            "generators": num_generators,
            "mode": mode,
            "degree": degree,
            "rows": rows,
            "faults": {str(i): {"version": f.version, "kind": f.kind} for i, f in (faults or {}).items()},
            "num_live": sum(g.alive for g in fleet.generators),
            "wrong_or_corrupt": wrong,
        }
    finally:
        for w in watchers:
            w.cancel()
        await fleet.stop()


async def swap_memory(model_dir: Path, root: Path, versions: list[Version]) -> dict[str, Any]:
    """One generator's extra memory for a delta swap: staging on tmpfs, and Python-heap peak while pulling.

    The heap peak (``tracemalloc``: numpy arrays and bytes objects, not
    gRPC's own receive buffers) covers receiving the delta, applying it and
    hashing the version; the learner's delta is encoded before tracing starts.
    """
    import tracemalloc

    fleet = await start_fleet(model_dir, root, 1, 0, True, None)
    try:
        [g] = fleet.generators
        first, second = versions[0], versions[1]
        for v in (first, second):
            fleet.store.put(v)
        fleet.store.delta(second.version, first.version, first.digest)
        policy = rollout_pb2.PolicyVersion(
            version=first.version, weights_endpoint=fleet.learner_endpoint, digest=first.digest
        )
        assert await g.swapper.update(policy)
        staging_before = g.swapper.staging.usage()
        tracemalloc.start()
        policy = rollout_pb2.PolicyVersion(
            version=second.version, weights_endpoint=fleet.learner_endpoint, digest=second.digest
        )
        assert await g.swapper.update(policy)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        held = g.relay._held
        return {
            "version_bytes": second.num_bytes,
            "staging_bytes_before": staging_before,
            "staging_bytes_after": g.swapper.staging.usage(),
            "heap_peak_bytes": peak,
            "held_delta_bytes": held.delta.num_bytes if held is not None and held.delta is not None else 0,
        }
    finally:
        await fleet.stop()


def interior_faults(num_generators: int, degree: int, version: int) -> dict[int, Fault]:
    """Two generators with children misbehave on ``version``: the first dies mid-transfer, the second corrupts."""
    interior = [i for i in range(num_generators) if (i + 1) * degree < num_generators]
    if len(interior) < 2:
        return {}
    return {interior[0]: Fault(version, "dies"), interior[-1]: Fault(version, "corrupts")}


# -- the benchmark -----------------------------------------------------------------------


def measure(workdir: Path, quick: bool, link_mb_per_s: float, fleets: tuple[int, ...] | None = None) -> dict[str, Any]:
    from services.embedded.build import cast_model_dir, create_model_dir

    spec = QUICK_SPEC if quick else FULL_SPEC
    degree = QUICK_DEGREE if quick else DEGREE
    model_dir = cast_model_dir(create_model_dir(spec, ALPHABET, workdir / "model"), _bf16())
    num_versions = 3 if quick else 4
    started = time.monotonic()
    versions = learner_versions(model_dir, PAPER_LR, num_versions)
    tiny = learner_versions(model_dir, TINY_LR, 3)
    learner_s = time.monotonic() - started
    link = link_mb_per_s * 1e6 if link_mb_per_s > 0 else None
    with tempfile.TemporaryDirectory(prefix="fanout-memory-", dir=_tmpfs()) as tmp:
        memory = asyncio.run(swap_memory(model_dir, Path(tmp), versions))
    runs = []
    for n in fleets or (QUICK_FLEETS if quick else FLEETS):
        for mode in MODES:
            faults = interior_faults(n, degree, versions[2].version) if mode == "tree-delta" else None
            with tempfile.TemporaryDirectory(prefix=f"fanout-{n}-{mode}-", dir=_tmpfs()) as tmp:
                t0 = time.monotonic()
                run = asyncio.run(run_fleet(model_dir, Path(tmp), versions, n, mode, link, degree, faults))
            run["wall_s"] = time.monotonic() - t0
            log.info("%d generators, %s: %s", n, mode, [round(r["time_s"], 2) for r in run["rows"]])
            runs.append(run)
    return {
        "spec": spec.model_dump(),
        "num_parameters": sum(math.prod(s) for _, s in read_signature(model_dir).values()),
        "version_bytes": versions[0].num_bytes,
        "lr": PAPER_LR,
        "deltas": delta_sizes(versions),
        "deltas_tiny_lr": {"lr": TINY_LR, "rows": delta_sizes(tiny)},
        "link_mb_per_s": link_mb_per_s,
        "degree": degree,
        "learner_steps_s": learner_s,
        "swap_memory": memory,
        "runs": runs,
    }


def _bf16() -> Any:
    import torch

    return torch.bfloat16


def _tmpfs() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def link_bound_s(num_generators: int, degree: int, bytes_per_pull: float, link_mb_per_s: float) -> float | None:
    """The time links alone would take (each node sends one frame at a time, no CPU cost): a model.

    Star: the learner sends every generator's pull. Tree: each level's senders
    send ``degree`` pulls each, level after level (store and forward).
    """
    if link_mb_per_s <= 0:
        return None
    one = bytes_per_pull / (link_mb_per_s * 1e6)
    if degree == 0:
        return num_generators * one
    depth, reached, width = 0, 0, degree
    while reached < num_generators:
        depth, reached, width = depth + 1, reached + width, width * degree
    return depth * min(degree, num_generators) * one


def delta_rows(m: dict[str, Any]) -> list[dict[str, Any]]:
    """Per fleet and mode, the delta versions' medians (versions after the first, which every generator pulls whole)."""
    out = []
    for run in m["runs"]:
        later = run["rows"][1:]
        fault_version = next((f["version"] for f in run["faults"].values()), None)
        received = float(np.median([r["received_bytes"] / max(1, r["num_held"]) for r in later]))
        out.append(
            {
                "generators": run["generators"],
                "mode": run["mode"],
                "first_time_s": run["rows"][0]["time_s"],
                "time_s": float(np.median([r["time_s"] for r in later])),
                "learner_egress_bytes": float(np.median([r["learner_egress_bytes"] for r in later])),
                "first_learner_egress_bytes": run["rows"][0]["learner_egress_bytes"],
                "fault_learner_egress_bytes": next(
                    (r["learner_egress_bytes"] for r in run["rows"] if r["version"] == fault_version), None
                ),
                "received_bytes_per_generator": received,
                "link_bound_time_s": link_bound_s(run["generators"], run["degree"], received, m["link_mb_per_s"]),
                "peer_failures": sum(r["peer_failures"] for r in run["rows"]),
                "fallbacks": sum(r["pulls_by_kind"]["fallback"] for r in run["rows"]),
                "died": sum(r["num_died"] for r in run["rows"]),
                "faults": run["faults"],
                "wrong_or_corrupt": len(run["wrong_or_corrupt"]),
                "num_live": run["num_live"],
            }
        )
    return out


def figures(m: dict[str, Any]) -> list[Figure]:
    rows = delta_rows(m)
    version_bytes = m["version_bytes"]
    deltas = m["deltas"]
    delta_ratio = float(np.median([d["delta_bytes"] / d["full_bytes"] for d in deltas]))
    changed = float(np.median([d["changed_fraction"] for d in deltas]))
    biggest = max(r["generators"] for r in rows)
    tree = next(r for r in rows if r["generators"] == biggest and r["mode"] == "tree-delta")
    star_full = next(r for r in rows if r["generators"] == biggest and r["mode"] == "star-full")
    faulted = [r for r in rows if r["faults"]]
    wrong = sum(r["wrong_or_corrupt"] for r in rows)
    return [
        Figure(
            name="weights_delta_bytes",
            value=delta_ratio,
            unit="x",
            ratio=delta_ratio,
            baseline=f"the whole version, {version_bytes / 1e6:.1f} MB bf16",
            measured=(
                f"median delta after one AdamW step at lr {m['lr']:g}: {changed:.2%} of bf16 elements changed, "
                f"{delta_ratio * version_bytes / 1e6:.2f} MB on the wire ({len(deltas)} steps)"
            ),
            targets=(Target(of="ratio", direction="at most", bound=0.2),),
            details={"deltas": deltas, "tiny_lr": m["deltas_tiny_lr"]},
        ),
        Figure(
            name="weights_fanout_learner_egress",
            value=tree["learner_egress_bytes"],
            unit="B",
            ratio=tree["first_learner_egress_bytes"] / version_bytes,
            baseline=(
                f"every generator from the learner, whole versions: {star_full['learner_egress_bytes'] / 1e6:,.0f} MB "
                f"per version at {biggest} generators"
            ),
            measured=(
                f"tree of degree {m['degree']} with deltas at {biggest} generators: the learner sent "
                f"{tree['learner_egress_bytes'] / 1e6:.2f} MB per delta version and "
                f"{tree['first_learner_egress_bytes'] / version_bytes:.2f} versions' bytes for the first (whole) one"
            ),
            targets=(Target(of="ratio", direction="at most", bound=m["degree"] + 1, rule="degree + 1 versions"),),
            details={"rows": rows},
        ),
        Figure(
            name="weights_fanout_time",
            value=tree["time_s"],
            unit="s",
            ratio=star_full["time_s"] / tree["time_s"] if tree["time_s"] else None,
            baseline=f"every generator pulls whole versions from the learner: {star_full['time_s']:.2f} s",
            measured=(
                f"time until all {biggest} generators hold a version, tree with deltas (median over delta versions; "
                f"{m['link_mb_per_s']:g} MB/s simulated egress per node, all nodes on {os.cpu_count()} cores)"
            ),
            targets=(Target(of="ratio", direction="at least", bound=1.0),),
        ),
        Figure(
            name="weights_fanout_wrong_versions",
            value=float(wrong),
            unit="generators",
            baseline="0",
            measured=(
                f"live generators whose staged bytes' digest differ from the learner's, after "
                f"{sum(len(r['faults']) for r in faulted)} injected faults (a peer dying mid-transfer, a peer "
                f"corrupting bytes) in {len(faulted)} runs: {sum(r['peer_failures'] for r in faulted):.0f} pulls "
                f"moved up the tree"
            ),
            targets=(Target(of="value", direction="at most", bound=0.0),),
        ),
    ]


def plot(m: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = delta_rows(m)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in zip(MODES, ("o-", "s--", "^-", "d--")):
        sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["generators"])
        xs = [r["generators"] for r in sel]
        axes[0].plot(xs, [r["learner_egress_bytes"] / 1e6 for r in sel], style, label=mode)
        axes[1].plot(xs, [r["time_s"] for r in sel], style, label=mode)
    axes[0].set_ylabel("learner egress per version (MB)")
    axes[1].set_ylabel("time until every generator holds it (s)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated generators")
        ax.legend()
    fig.suptitle(
        f"Weight fan-out: {m['version_bytes'] / 1e6:.0f} MB bf16 versions, tree degree {m['degree']}, "
        f"{m['link_mb_per_s']:g} MB/s per node"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(out: Path, m: dict[str, Any], figs: list[Figure]) -> None:
    (out / BENCH_FILE_NAME).write_text(
        json.dumps({**m, "figures": [f.as_json() for f in figs]}, indent=2, default=float) + "\n"
    )
    mb = m["version_bytes"] / 1e6
    lines = [
        "# Weight fan-out",
        "",
        f"{m['num_parameters'] / 1e6:.1f}M parameters, {mb:.1f} MB per version in bf16; versions one AdamW step "
        f"apart at lr {m['lr']:g}; tree degree {m['degree']}; {m['link_mb_per_s']:g} MB/s simulated egress per "
        f"node; {os.cpu_count()} cores for every simulated node.",
        "",
        "| figure | value | target | result |",
        "|---|---|---|---|",
    ]
    for f in figs:
        shown = f"{f.value:.3f}" if f.unit == "x" else f"{f.value:,.2f} {f.unit}" if f.value is not None else "-"
        lines.append(f"| {f.name} | {shown} | {f.target} | {f.verdict} |")
    lines += [
        "",
        "## Deltas",
        "",
        "| lr | version | changed elements | delta MB | whole MB | gaps / mask / dense windows |",
        "|---|---|---|---|---|---|",
    ]
    for lr, ds in ((m["lr"], m["deltas"]), (m["deltas_tiny_lr"]["lr"], m["deltas_tiny_lr"]["rows"])):
        for d in ds:
            w = d["windows_by_encoding"]
            lines.append(
                f"| {lr:g} | {d['version']} | {d['changed_fraction']:.3%} | {d['delta_bytes'] / 1e6:.3f} | "
                f"{d['full_bytes'] / 1e6:.1f} | {w['gaps']} / {w['mask']} / {w['dense']} |"
            )
    lines += [
        "",
        "## Fan-out",
        "",
        "Delta versions: the median over the versions after the first; the first is whole for every generator.",
        "",
        "| generators | mode | time to all, first (s) | time to all, delta versions (s) | link-bound time, "
        "modelled (s) | learner egress, first (MB) "
        "| learner egress per delta version (MB) | received per generator (MB) | faults | learner egress on the "
        "faults' version (MB) | moved up | fallbacks | wrong or corrupt |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in delta_rows(m):
        faults = ", ".join(f"{f['kind']} (g{i})" for i, f in r["faults"].items()) or "-"
        egress = r["fault_learner_egress_bytes"]
        modelled = "-" if r["link_bound_time_s"] is None else f"{r['link_bound_time_s']:.3f}"
        fault_egress = "-" if egress is None else f"{egress / 1e6:.2f}"
        lines.append(
            f"| {r['generators']} | {r['mode']} | {r['first_time_s']:.2f} | {r['time_s']:.2f} | {modelled} | "
            f"{r['first_learner_egress_bytes'] / 1e6:.1f} | {r['learner_egress_bytes'] / 1e6:.2f} | "
            f"{r['received_bytes_per_generator'] / 1e6:.3f} | {faults} | {fault_egress} | {r['peer_failures']:.0f} | "
            f"{r['fallbacks']:.0f} | {r['wrong_or_corrupt']} of {r['num_live']} |"
        )
    if "swap_memory" in m:
        sm = m["swap_memory"]
        lines += [
            "",
            "## A delta swap's extra memory (one generator)",
            "",
            f"Staging on tmpfs: {sm['staging_bytes_before'] / 1e6:.2f} MB before the delta swap, "
            f"{sm['staging_bytes_after'] / 1e6:.2f} MB after (the version is {sm['version_bytes'] / 1e6:.2f} MB: "
            f"the delta is applied in place over the staged file). Python-heap peak while receiving, applying "
            f"and verifying the delta: {sm['heap_peak_bytes'] / 1e6:.2f} MB; the delta kept to serve peers: "
            f"{sm['held_delta_bytes'] / 1e6:.2f} MB.",
        ]
    lines += ["", "![scaling](scaling-weights.png)"]
    (out / "bench.md").write_text("\n".join(lines) + "\n")


def bench_fanout(
    out: Path, quick: bool = False, link_mb_per_s: float = 200.0, fleets: tuple[int, ...] | None = None
) -> list[Figure]:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fanout-bench-") as tmp:
        m = measure(Path(tmp), quick, link_mb_per_s, fleets)
    figs = figures(m)
    write_report(out, m, figs)
    plot(m, out / "scaling-weights.png")
    return figs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fanout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="directory for bench.md and the figure")
    parser.add_argument("--quick", action="store_true", help="a 0.5M-parameter model and 1 or 8 generators")
    parser.add_argument(
        "--link-mb-per-s", type=float, default=200.0, help="simulated egress of each node, MB/s (0: unpaced)"
    )
    parser.add_argument(
        "--rewrite", action="store_true", help=f"write bench.md and the figure again from DIR/{BENCH_FILE_NAME}"
    )
    args = parser.parse_args(argv)
    if args.rewrite:
        path = args.output / BENCH_FILE_NAME
        if not path.is_file():
            parser.error(f"--rewrite needs {path}, from an earlier run")
        m = json.loads(path.read_text())
        figs = figures(m)
        write_report(args.output, m, figs)
        plot(m, args.output / "scaling-weights.png")
        return 0
    if args.link_mb_per_s < 0:
        parser.error("--link-mb-per-s must be >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in ("services.generator", "asymptote.rpc"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    for f in bench_fanout(args.output, args.quick, args.link_mb_per_s):
        print(f"{f.name}: {f.measured} vs {f.baseline} (target {f.target}; {f.verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
