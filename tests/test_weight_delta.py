"""Weight deltas and the fan-out tree: bit-exact rebuilds, refusals that fall back, peers that fail.

Deltas are checked bit for bit against the version they encode (random
tensors and changes, float32, float16 and bf16, windows smaller than the
wire's so one tensor spans several). Over real gRPC: the learner's server
answers a held base with a delta and a base it no longer holds with the
whole version; a delta that is corrupted or from another base is refused
and the version pulled whole; a peer that dies mid-transfer, or is not
there, hands the pull to the next one up the tree. A small fleet of
simulated generators (the benchmark's, running the generator's own swapper
and relay) checks the learner's egress and every generator's final bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from unittest import mock

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asymptote.codec import WireTensor, encode_frames, signature_num_bytes, tensor_views, version_digest
from asymptote.config import ListenSettings
from asymptote.contracts.v1 import services_pb2, tensors_pb2
from asymptote.delta import DeltaDecoder, DeltaStats, apply_delta, decode_gaps, delta_frames, encode_gaps
from asymptote.errors import WeightsError
from asymptote.health import Health
from asymptote.nats_local import free_port
from asymptote.rpc import add_service, start_server
from services.generator.config import FanoutSettings
from services.generator.fanout import PeerWeightSource, ancestors, own_index, parent_of, peer_endpoints
from services.generator.metrics import GeneratorMetrics
from services.generator.weights import GrpcWeightSource, StagingArea
from services.learner.server import LearnerServicer, add_learner_to_server
from services.learner.weights import Version, WeightStore

GAPS, MASK, DENSE = tensors_pb2.DELTA_ENCODING_GAPS, tensors_pb2.DELTA_ENCODING_MASK, tensors_pb2.DELTA_ENCODING_DENSE
UNSPECIFIED = tensors_pb2.DELTA_ENCODING_UNSPECIFIED
DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}


def tensor(values: np.ndarray, dtype: str) -> WireTensor:
    if dtype == "bfloat16":
        return WireTensor("bfloat16", values.shape, (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes())
    return WireTensor.from_numpy(values.astype(DTYPES[dtype]))


def changed(t: WireTensor, rng: np.random.Generator, fraction: float) -> WireTensor:
    """``t`` with about ``fraction`` of its elements nudged (a few to signed zero), bit patterns otherwise kept."""
    itemsize = np.dtype(DTYPES[t.dtype]).itemsize
    words = np.frombuffer(t.data, dtype=f"<u{itemsize}").copy()
    picked = rng.random(len(words)) < fraction
    words[picked] ^= 1  # the last mantissa bit: a finite value stays finite
    zeros = picked & (rng.random(len(words)) < 0.1)
    words[zeros] = 1 << (8 * itemsize - 1)  # -0.0: equal to +0.0 as a number, not as bits
    return WireTensor(t.dtype, t.shape, words.tobytes())


def model_of(seed: int, dtype: str, sizes: list[int]) -> dict[str, WireTensor]:
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": tensor(rng.standard_normal(n).astype(np.float32), dtype) for i, n in enumerate(sizes)}


def buffer_of(tensors: dict[str, WireTensor]) -> np.ndarray:
    return np.concatenate([np.frombuffer(tensors[n].data, np.uint8) for n in sorted(tensors)] + [np.empty(0, np.uint8)])


def signature_of(tensors: dict[str, WireTensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (t.dtype, t.shape) for name, t in tensors.items()}


# -- the encoding ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    sizes=st.lists(st.integers(0, 700), min_size=1, max_size=4),
    fraction=st.sampled_from([0.0, 0.002, 0.05, 0.3, 0.9, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_a_delta_rebuilds_the_version_bit_for_bit(dtype: str, sizes: list[int], fraction: float, seed: int) -> None:
    base = model_of(seed, dtype, sizes)
    rng = np.random.default_rng(seed + 1)
    target = {name: changed(t, rng, fraction) for name, t in base.items()}
    stats = DeltaStats()
    with mock.patch("asymptote.delta.CHUNK_BYTES", 128):  # windows of 32 or 64 elements: several per tensor
        frames = delta_frames(7, target, version_digest(target), 6, base, version_digest(base), stats)
        rebuilt = apply_delta(frames, signature_of(base), buffer_of(base), version_digest(base))
    assert rebuilt.version == 7 and rebuilt.digest == version_digest(target)
    assert buffer_of(rebuilt.tensors).tobytes() == buffer_of(target).tobytes()
    num_changed = sum(
        int((np.frombuffer(base[n].data, np.uint8) != np.frombuffer(target[n].data, np.uint8)).any()) for n in base
    )
    assert (len(frames) > 1) == (num_changed > 0)
    assert stats.num_elements == sum(sizes)
    assert sum(map(len, frames)) <= sum(len(t.data) for t in target.values()) + 200 + 64 * len(frames)


@given(st.sets(st.integers(0, (1 << 19) - 1), max_size=300))
def test_varint_gaps_round_trip(positions: set[int]) -> None:
    p = np.array(sorted(positions), dtype=np.int64)
    assert decode_gaps(encode_gaps(p), 1 << 19).tolist() == p.tolist()


def test_each_window_takes_its_smallest_encoding() -> None:
    base = model_of(0, "bfloat16", [1 << 19, 1 << 19, 1 << 19])
    rng = np.random.default_rng(2)
    target = {
        "layer0.weight": changed(base["layer0.weight"], rng, 0.002),  # a few bytes a change: gaps
        "layer1.weight": changed(base["layer1.weight"], rng, 0.3),  # an eighth of a byte an element: mask
        "layer2.weight": changed(base["layer2.weight"], rng, 0.97),  # whole
    }
    stats = DeltaStats()
    frames = delta_frames(2, target, "", 1, base, version_digest(base), stats)
    assert stats.windows_by_encoding == {"gaps": 1, "mask": 1, "dense": 1}
    n = 1 << 19
    assert stats.bytes_by_encoding["dense"] == 2 * n
    assert stats.bytes_by_encoding["mask"] < n // 8 + 2 * 0.32 * n
    assert stats.bytes_by_encoding["gaps"] < 4 * 0.0025 * n  # 2 bytes a value, at most 2 a gap under 2^14
    assert apply_delta(frames, signature_of(base), buffer_of(base), version_digest(base)).digest == version_digest(
        target
    )


def malformed(part: tensors_pb2.TensorDelta) -> list[bytes]:
    header = tensors_pb2.WeightsHeader(
        version=2, num_tensors=1, num_bytes=200, digest="0" * 64, base_version=1, base_digest="b" * 64
    )
    return [
        tensors_pb2.WeightsPart(header=header).SerializeToString(),
        tensors_pb2.WeightsPart(delta=part).SerializeToString(),
    ]


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (tensors_pb2.TensorDelta(name="nope", num_elements=1, encoding=DENSE, values=b"xx"), "does not have"),
        (
            tensors_pb2.TensorDelta(name="w", start=90, num_elements=20, encoding=DENSE, values=b"x" * 40),
            r"\[90, 110\)",
        ),
        (tensors_pb2.TensorDelta(name="w", num_elements=4, encoding=DENSE, values=b"x" * 6), "holds 6 bytes"),
        (tensors_pb2.TensorDelta(name="w", num_elements=9, encoding=GAPS, positions=b"\x80"), "inside a varint"),
        (tensors_pb2.TensorDelta(name="w", num_elements=9, encoding=GAPS, positions=b"\x09"), "outside its window"),
        (tensors_pb2.TensorDelta(name="w", num_elements=9, encoding=GAPS, positions=b"\x01", values=b"x"), "1 bytes"),
        (
            tensors_pb2.TensorDelta(name="w", num_elements=9, encoding=MASK, positions=b"\x01", values=b"xx"),
            "mask of 1",
        ),
        (
            tensors_pb2.TensorDelta(name="w", num_elements=9, encoding=UNSPECIFIED, values=b"xx"),
            "unknown delta encoding",
        ),
    ],
)
def test_a_malformed_delta_window_is_refused(part: tensors_pb2.TensorDelta, message: str) -> None:
    base = np.zeros(200, np.uint8)
    with pytest.raises(WeightsError, match=message):
        apply_delta(malformed(part), {"w": ("bfloat16", (100,))}, base, "b" * 64)
    assert not base.any(), "nothing was written: the stream was refused before its windows were applied"


def test_a_delta_from_another_base_or_for_another_model_is_refused() -> None:
    header = tensors_pb2.WeightsHeader(version=2, num_tensors=1, num_bytes=200, base_version=1, base_digest="b" * 64)
    with pytest.raises(WeightsError, match="from a base with digest bbbbbbbbbbbb"):
        DeltaDecoder(header, {"w": ("bfloat16", (100,))}, mock.Mock(), "c" * 64)
    with pytest.raises(WeightsError, match="the model has 1 of 202"):
        DeltaDecoder(header, {"w": ("bfloat16", (101,))}, mock.Mock(), "b" * 64)


# -- over gRPC -----------------------------------------------------------------------------


def version_of(number: int, tensors: dict[str, WireTensor]) -> Version:
    return Version(number, tensors, version_digest(tensors))


def versions(num: int) -> list[Version]:
    """Versions a step apart: 2% of elements changed each time."""
    tensors = model_of(0, "bfloat16", [600_000, 3000, 17])
    rng = np.random.default_rng(1)
    out = [version_of(1, tensors)]
    for number in range(2, num + 1):
        tensors = {name: changed(t, rng, 0.02) for name, t in tensors.items()}
        out.append(version_of(number, tensors))
    return out


@asynccontextmanager
async def learner(store: WeightStore) -> AsyncIterator[str]:
    servicer = LearnerServicer(store, Health("learner"), "test", dict)
    server, port = await start_server(
        ListenSettings(host="127.0.0.1", port=0), Health("learner"), lambda s: add_learner_to_server(servicer, s), []
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@asynccontextmanager
async def stub_server(service: str, answer: object) -> AsyncIterator[str]:
    """A PullWeights server whose frames come from ``answer(request)``."""

    class Stub:
        async def PullWeights(
            self, request: services_pb2.PullWeightsRequest, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            async for frame in answer(request):  # type: ignore[operator]
                yield frame

        async def Status(self, request: services_pb2.StatusRequest, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a stub")

    server, port = await start_server(
        ListenSettings(host="127.0.0.1", port=0),
        Health(service),
        lambda s: add_service(s, services_pb2.DESCRIPTOR.services_by_name[service], Stub(), ["PullWeights"]),
        [],
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def staged_bytes(area: StagingArea) -> bytes:
    [file] = list(area.root.rglob("*.safetensors"))
    raw = file.read_bytes()
    return raw[8 + int.from_bytes(raw[:8], "little") :]


async def stage_version(
    source: GrpcWeightSource | PeerWeightSource, endpoint: str, area: StagingArea, v: Version, model_dir: Path
) -> None:
    """What the swapper does: pull with the held base, check the digest, commit, recycle."""
    staged = area.open(v.version, signature_of(v.tensors))
    weights = await source.pull(endpoint, v.version, into=staged, base=staged.base)
    assert weights.digest == v.digest
    area.recycle(staged.commit(model_dir, weights.digest))


def pulls(metrics: GeneratorMetrics) -> dict[str, float]:
    return {kind: metrics.weight_pulls.labels(kind)._value.get() for kind in ("delta", "full", "fallback")}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path / "model"


async def test_a_held_base_gets_a_delta_and_a_base_too_old_gets_the_whole_version(
    tmp_path: Path, model_dir: Path
) -> None:
    vs = versions(4)
    store = WeightStore(signature_of(vs[0].tensors), keep=2)
    metrics = GeneratorMetrics()
    source = GrpcWeightSource(timeout_s=10, metrics=metrics)
    area = StagingArea(tmp_path / "staged")
    async with learner(store) as endpoint:
        store.put(vs[0])
        await stage_version(source, endpoint, area, vs[0], model_dir)
        store.put(vs[1])
        await stage_version(source, endpoint, area, vs[1], model_dir)
        assert pulls(metrics) == {"delta": 1, "full": 1, "fallback": 0}
        delta_bytes = metrics.weight_pull_bytes.labels("delta")._value.get()
        assert delta_bytes < 0.1 * vs[1].num_bytes
        assert staged_bytes(area) == buffer_of(vs[1].tensors).tobytes()
        store.put(vs[2])
        store.put(vs[3])  # version 2, which the generator holds, is dropped
        await stage_version(source, endpoint, area, vs[3], model_dir)
    assert pulls(metrics) == {"delta": 1, "full": 2, "fallback": 0}
    assert staged_bytes(area) == buffer_of(vs[3].tensors).tobytes()


def corrupted(frames: list[bytes]) -> list[bytes]:
    last = bytearray(frames[-1])
    last[-1] ^= 0x10
    return [*frames[:-1], bytes(last)]


@pytest.mark.parametrize("fault", ["corrupted", "another base", "another digest"])
async def test_a_delta_that_fails_its_checks_is_pulled_again_whole(tmp_path: Path, model_dir: Path, fault: str) -> None:
    v1, v2 = versions(2)
    rng = np.random.default_rng(9)
    other = {name: changed(t, rng, 0.01) for name, t in v1.tensors.items()}  # a base that is not v1
    bad = {
        "corrupted": corrupted(delta_frames(2, v2.tensors, v2.digest, 1, v1.tensors, v1.digest)),
        # Diffed against another base while claiming v1's digest: elements that base shares with v2 are missing.
        "another base": delta_frames(2, v2.tensors, v2.digest, 1, other, v1.digest),
        "another digest": delta_frames(2, v2.tensors, v2.digest, 1, v1.tensors, "f" * 64),
    }[fault]
    asked: list[int] = []

    async def answer(request: services_pb2.PullWeightsRequest) -> AsyncIterator[bytes]:
        asked.append(int(request.base_version))
        frames = bad if request.base_version else encode_frames(2, v2.tensors, v2.digest)
        for frame in frames:
            yield frame

    area = StagingArea(tmp_path / "staged")
    stage = area.open(1, signature_of(v1.tensors))
    stage.take(v1.num_bytes)[:] = buffer_of(v1.tensors)
    area.recycle(stage.commit(model_dir, v1.digest))
    metrics = GeneratorMetrics()
    async with stub_server("Learner", answer) as endpoint:
        await stage_version(GrpcWeightSource(timeout_s=10, metrics=metrics), endpoint, area, v2, model_dir)
    assert asked == [1, 0]
    assert pulls(metrics) == {"delta": 0, "full": 0, "fallback": 1}
    assert staged_bytes(area) == buffer_of(v2.tensors).tobytes()


@pytest.mark.parametrize("sending", ["whole", "delta"])
async def test_a_peer_that_dies_mid_transfer_hands_the_pull_up_the_tree(
    tmp_path: Path, model_dir: Path, sending: str
) -> None:
    v1, v2 = versions(2)
    store = WeightStore(signature_of(v1.tensors), keep=2)
    store.put(v1)
    store.put(v2)
    frames = (
        list(encode_frames(2, v2.tensors, v2.digest))
        if sending == "whole"
        else delta_frames(2, v2.tensors, v2.digest, 1, v1.tensors, v1.digest)
    )
    died = asyncio.Event()

    async def dies(request: services_pb2.PullWeightsRequest) -> AsyncIterator[bytes]:
        for frame in frames[:2]:
            yield frame
        died.set()
        raise RuntimeError("the peer's process died")

    area = StagingArea(tmp_path / "staged")
    metrics = GeneratorMetrics()
    async with learner(store) as learner_endpoint:
        await stage_version(GrpcWeightSource(timeout_s=10), learner_endpoint, area, v1, model_dir)
        async with stub_server("WeightRelay", dies) as dying:
            nobody = f"127.0.0.1:{free_port()}"
            source = PeerWeightSource([dying, nobody], peer_timeout_s=5, timeout_s=10, metrics=metrics)
            await stage_version(source, learner_endpoint, area, v2, model_dir)
    assert died.is_set()
    assert metrics.weight_peer_failures._value.get() == 2
    if sending == "whole":  # written straight into the staged file: the base is gone, the learner sends it whole
        assert pulls(metrics) == {"delta": 0, "full": 1, "fallback": 0}
    else:  # a delta is applied only once it is all there: the base is intact, the learner sends a delta
        assert pulls(metrics) == {"delta": 1, "full": 0, "fallback": 0}
    assert staged_bytes(area) == buffer_of(v2.tensors).tobytes()


# -- the tree ----------------------------------------------------------------------------


def test_the_tree_bounds_every_node_to_degree_children() -> None:
    for degree in (1, 2, 4, 8):
        children: dict[int | None, int] = {}
        for i in range(300):
            parent = parent_of(i, degree)
            children[parent] = children.get(parent, 0) + 1
            assert parent is None or parent < i
        assert max(children.values()) == degree
    assert ancestors(13, 2) == [5, 1]  # 13 -> 13 // 2 - 1 = 5 -> 5 // 2 - 1 = 1 -> the learner
    settings = FanoutSettings(degree=2, peer_endpoint="127.0.0.1:5{index:04d}")
    assert peer_endpoints(settings, 13) == ["127.0.0.1:50005", "127.0.0.1:50001"]
    assert own_index(FanoutSettings(degree=2), "asymptote-generator-17") == 17
    with pytest.raises(ValueError, match="does not end with a number"):
        own_index(FanoutSettings(degree=2), "generator")
    with pytest.raises(ValueError, match="must contain"):
        FanoutSettings(peer_endpoint="gen:50061")


@pytest.mark.slow  # real AdamW steps on a small model, then 8 generators over gRPC, ~20 s
def test_a_small_tree_sends_each_version_degree_times_and_every_generator_ends_right(tmp_path: Path) -> None:
    from benchmarks.fanout import QUICK_SPEC, interior_faults, learner_versions, run_fleet
    from services.embedded.build import cast_model_dir, create_model_dir

    torch = pytest.importorskip("torch")
    model_dir = cast_model_dir(create_model_dir(QUICK_SPEC, "0123456789+-=", tmp_path / "model"), torch.bfloat16)
    vs = learner_versions(model_dir, 5e-7, 4)
    degree, n = 2, 8

    def whole_bytes(v: Version) -> int:
        return sum(map(len, encode_frames(v.version, v.tensors, v.digest)))

    def delta_bytes(base: Version, v: Version) -> int:
        return sum(map(len, delta_frames(v.version, v.tensors, v.digest, base.version, base.tensors, base.digest)))

    run = asyncio.run(run_fleet(model_dir, tmp_path / "fleet", vs, n, "tree-delta", None, degree))
    rows = run["rows"]
    assert [r["num_held"] for r in rows] == [n] * len(vs)
    assert rows[0]["learner_egress_bytes"] == degree * whole_bytes(vs[0])
    for base, v, row in zip(vs, vs[1:], rows[1:]):
        assert row["learner_egress_bytes"] == degree * delta_bytes(base, v)
        assert row["pulls_by_kind"] == {"delta": n, "full": 0, "fallback": 0}
    assert run["wrong_or_corrupt"] == []

    faults = interior_faults(n, degree, vs[2].version)
    assert sorted(f.kind for f in faults.values()) == ["corrupts", "dies"]
    run = asyncio.run(run_fleet(model_dir, tmp_path / "faulty", vs, n, "tree-delta", None, degree, faults))
    assert run["num_live"] == n - 1
    assert run["rows"][2]["peer_failures"] > 0
    assert run["wrong_or_corrupt"] == [], "every live generator's staged bytes hash to the learner's version"
    # Bounded even with faults: no more than every generator's worth of whole versions.
    assert max(r["learner_egress_bytes"] for r in run["rows"]) <= n * whole_bytes(vs[0])


def test_a_staged_file_keeps_its_data_where_the_version_before_left_it(tmp_path: Path, model_dir: Path) -> None:
    tensors = model_of(0, "bfloat16", [10, 7])
    signature = signature_of(tensors)
    area = StagingArea(tmp_path / "staged")
    offsets = []
    for version in (9, 10, 123456789):
        staged = area.open(version, signature)
        staged.take(signature_num_bytes(signature))[:] = buffer_of(tensors)
        folder = staged.commit(model_dir, version_digest(tensors))
        raw = (folder / "model.safetensors").read_bytes()
        offsets.append(8 + int.from_bytes(raw[:8], "little"))
        assert version_digest(tensor_views(np.frombuffer(raw[offsets[-1] :], np.uint8), signature)) == version_digest(
            tensors
        )
        area.recycle(folder)
    assert len(set(offsets)) == 1 and offsets[0] % 8 == 0
