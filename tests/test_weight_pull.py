"""A version pulled over real gRPC: the learner's server, the generator's pull and staging.

The learner's ``PullWeights`` sends pre-serialized frames that must be
exactly the codec's parts; the generator's pull verifies them as they
arrive, so a bad stream is refused at its first bad part and named; staging
writes the verified bytes unchanged.
"""

from __future__ import annotations

import asyncio
import platform
import random
import resource
import signal
import subprocess
import sys
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors import safe_open

from asymptote.codec import (
    CHUNK_BYTES,
    DecodedWeights,
    WireTensor,
    decode,
    encode,
    encode_frames,
    version_digest,
)
from asymptote.config import ListenSettings
from asymptote.contracts.v1 import services_pb2, services_pb2_grpc
from asymptote.errors import StagingError, WeightsError
from asymptote.health import Health
from asymptote.rpc import start_server
from services.generator.weights import (
    STAGED_FILE,
    GrpcWeightSource,
    StagingArea,
    check_signature,
    stage,
)
from services.learner.server import LearnerServicer, add_learner_to_server
from services.learner.weights import Version, WeightStore
from tests.helpers.badinput import BAD_INPUTS, raw_stream_server

PULL_WEIGHTS = "/asymptote.contracts.v1.Learner/PullWeights"


def random_tensors(seed: int) -> dict[str, WireTensor]:
    rng = np.random.default_rng(seed)
    return {
        "big": WireTensor.from_numpy(rng.standard_normal(CHUNK_BYTES // 4 * 2 + 11).astype(np.float32)),
        "embed": WireTensor.from_numpy(rng.standard_normal((64, 16)).astype(np.float16)),
        "ids": WireTensor.from_numpy(rng.integers(-(2**40), 2**40, size=(5,))),
        "norm": WireTensor(
            "bfloat16", (16,), (rng.standard_normal(16).astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        ),
        "nothing": WireTensor.from_numpy(np.zeros((0, 4), dtype=np.float32)),
        "scale": WireTensor.from_numpy(np.array(0.5, dtype=np.float64)),
    }


def version_of(number: int, tensors: dict[str, WireTensor]) -> Version:
    return Version(number, tensors, version_digest(tensors))


@asynccontextmanager
async def learner(store: WeightStore) -> AsyncIterator[str]:
    """The learner's real weight server on loopback; yields its endpoint."""
    health = Health("learner")
    servicer = LearnerServicer(store, health, "test", dict)
    server, port = await start_server(
        ListenSettings(host="127.0.0.1", port=0),
        health,
        lambda s: add_learner_to_server(servicer, s),
        ["asymptote.contracts.v1.Learner"],
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def raw_learner(stream: Callable[[], AsyncIterator[bytes]]) -> AbstractAsyncContextManager[str]:
    """A PullWeights server sending whatever frames ``stream`` yields; yields its endpoint."""
    return raw_stream_server("Learner", "PullWeights", stream)


def frames_of(frames: list[bytes]) -> Callable[[], AsyncIterator[bytes]]:
    async def stream() -> AsyncIterator[bytes]:
        for frame in frames:
            yield frame

    return stream


def assert_same(weights: DecodedWeights, tensors: dict[str, WireTensor]) -> None:
    assert list(weights.tensors) == sorted(tensors)
    for name, t in tensors.items():
        got = weights.tensors[name]
        assert (got.dtype, got.shape, bytes(got.data)) == (t.dtype, t.shape, t.data), name


# -- the learner's server ------------------------------------------------------------


async def test_the_server_sends_the_codec_parts_and_the_generator_gets_the_same_bytes() -> None:
    tensors = random_tensors(1)
    store = WeightStore({})
    v = store.put(version_of(4, tensors))
    async with learner(store) as endpoint:
        async with grpc.aio.insecure_channel(endpoint) as ch:
            call = ch.unary_stream(PULL_WEIGHTS)  # raw bytes, as they travel
            frames = [f async for f in call(services_pb2.PullWeightsRequest(version=4).SerializeToString())]
        assert frames == [p.SerializeToString() for p in encode(4, tensors, v.digest)]
        assert frames == list(encode_frames(4, tensors))

        weights = await GrpcWeightSource(timeout_s=10).pull(endpoint, 4)
        assert (weights.version, weights.digest) == (4, v.digest)
        assert_same(weights, tensors)
        assert weights.num_bytes == v.num_bytes


async def test_a_version_not_held_is_not_found_and_status_is_still_served() -> None:
    store = WeightStore({}, keep=2)
    for number in (1, 2, 3):
        store.put(version_of(number, random_tensors(number)))
    async with learner(store) as endpoint:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await GrpcWeightSource(timeout_s=10).pull(endpoint, 1)  # dropped: only the newest two are held
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details() == "version 1 is not held; newest is 3"
        newest = await GrpcWeightSource(timeout_s=10).pull(endpoint, 3)
        assert_same(newest, random_tensors(3))
        async with grpc.aio.insecure_channel(endpoint) as ch:
            status = await services_pb2_grpc.LearnerStub(ch).Status(services_pb2.StatusRequest(), timeout=10)
        assert (status.service, status.instance_id, status.policy_version) == ("learner", "test", 3)


# -- the generator's pull: refusals ----------------------------------------------------


async def refuse_pull(frames: list[bytes], version: int, match: str, source: GrpcWeightSource | None = None) -> None:
    """A learner sending ``frames`` gets the generator's pull of ``version`` refused with ``match``; recorded."""
    async with raw_learner(frames_of(frames)) as endpoint:
        with (
            BAD_INPUTS.trying("weights", [f"PullWeights version {version}".encode(), *frames]),
            pytest.raises(WeightsError, match=match),
        ):
            await (source or GrpcWeightSource(timeout_s=10)).pull(endpoint, version)


async def test_a_stream_cut_short_is_refused_naming_the_tensor() -> None:
    parts = list(encode(2, random_tensors(2)))
    assert [p.chunk.name for p in parts[1:4]] == ["big", "big", "big"]
    frames = [p.SerializeToString() for p in parts]
    # Ends after two of big's three chunks, then before the last tensor.
    await refuse_pull(frames[:3], 2, f"tensor 'big': got {2 * CHUNK_BYTES} bytes of {2 * CHUNK_BYTES + 44}")
    await refuse_pull(frames[:-1], 2, "header announced 6 tensors, stream held 5")


async def test_a_corrupted_byte_is_refused() -> None:
    parts = list(encode(2, random_tensors(2)))
    data = bytearray(parts[2].chunk.data)
    data[777] ^= 0x04
    parts[2].chunk.data = bytes(data)
    await refuse_pull([p.SerializeToString() for p in parts], 2, "digest mismatch for version 2")


async def test_bytes_that_are_not_a_part_are_refused_and_the_next_pull_works() -> None:
    tensors = random_tensors(2)
    frames = list(encode_frames(2, tensors))
    source = GrpcWeightSource(timeout_s=10)
    rng = random.Random(5)
    for bad in [b"\xff", b"\xff" + rng.randbytes(100), frames[1][: len(frames[1]) // 2], frames[0][:-1]]:
        await refuse_pull([frames[0], bad, *frames[1:]], 2, "the learner sent bytes that are not a WeightsPart", source)
    await refuse_pull([b"\x0a\xff\xff\xff\xff\x0f"], 2, "not a WeightsPart", source)
    async with raw_learner(frames_of(frames)) as endpoint:
        assert_same(await source.pull(endpoint, 2), tensors)


async def test_a_bad_part_is_refused_when_it_arrives_not_when_the_stream_ends() -> None:
    parts = list(encode(2, random_tensors(2)))
    ended = asyncio.Event()
    sent = [parts[0].SerializeToString(), parts[2].SerializeToString()]  # big's second chunk first

    async def stream() -> AsyncIterator[bytes]:
        for frame in sent:
            yield frame
        try:
            await asyncio.sleep(3600)  # pacing: a learner that never sends the rest (cancelled by the client)
        finally:
            ended.set()
        yield b""

    async with raw_learner(stream) as endpoint:
        with (
            BAD_INPUTS.trying("weights", [b"PullWeights version 2", *sent]),
            pytest.raises(WeightsError, match=f"tensor 'big': chunk at offset {CHUNK_BYTES}, expected 0"),
        ):
            await asyncio.wait_for(GrpcWeightSource(timeout_s=60).pull(endpoint, 2), 20)
        await asyncio.wait_for(ended.wait(), 20)  # and the call was cancelled on the server


async def test_a_version_other_than_the_one_asked_for_is_refused() -> None:
    await refuse_pull(list(encode_frames(8, random_tensors(2))), 2, "asked for version 2, learner sent 8")


# -- staging -------------------------------------------------------------------------


def test_staging_writes_the_verified_bytes_unchanged(tmp_path: Path) -> None:
    tensors = random_tensors(3)
    weights = decode(list(encode(9, tensors)))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when handed read-only memory
        folder = stage(weights, tmp_path / "staged", model_dir)
    assert folder == tmp_path / "staged" / "v9"
    assert (folder / "config.json").read_text() == '{"model_type": "llama"}'
    torch_dtypes = {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
        "int64": torch.int64,
    }
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "version": "9"}
        assert sorted(f.keys()) == sorted(tensors)
        for name, t in tensors.items():
            staged = f.get_tensor(name)
            assert staged.dtype == torch_dtypes[t.dtype] and tuple(staged.shape) == t.shape, name
            raw = staged.view(torch.int16) if t.dtype == "bfloat16" else staged
            assert raw.numpy().tobytes() == t.data, name
    # Staged again (a restarted generator), the folder is replaced; bytes that
    # are not a pulled version's (read-only) are staged the same.
    from_bytes = DecodedWeights(9, weights.digest, tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert stage(from_bytes, tmp_path / "staged", model_dir) == folder
    assert sorted(p.name for p in (tmp_path / "staged").iterdir()) == ["v9"]
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        assert f.get_tensor("big").tobytes() == tensors["big"].data


def signature_of(tensors: dict[str, WireTensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (t.dtype, t.shape) for name, t in tensors.items()}


def model_dir_at(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    return path


async def test_a_pull_decodes_straight_into_one_file_that_the_next_pull_reuses(tmp_path: Path) -> None:
    """Staging holds one version's bytes at most: the file the pull writes is the file loaded, then the spare."""
    store = WeightStore({}, keep=4)
    for number in (1, 2):
        store.put(version_of(number, random_tensors(number)))
    signature = signature_of(random_tensors(1))
    area = StagingArea(tmp_path / "staged")
    model_dir = model_dir_at(tmp_path / "model")
    async with learner(store) as endpoint:
        staged = area.open(1, signature)
        weights = await GrpcWeightSource(timeout_s=10).pull(endpoint, 1, into=staged)
        folder = staged.commit(model_dir)
        file = folder / STAGED_FILE
        # The decoded tensors view the file itself: bytes written to it show through.
        with open(file, "r+b") as f:
            f.seek(8 + int.from_bytes(f.read(8), "little"))  # past the header, to the first tensor
            f.write(b"\x07\x07")
        assert bytes(weights.tensors["big"].data[:2]) == b"\x07\x07"
        del weights
        inode = file.stat().st_ino
        one_version = file.stat().st_size
        area.recycle(folder)  # loaded: kept as the next pull's buffer
        assert area.usage() == one_version

        staged = area.open(2, signature)
        weights = await GrpcWeightSource(timeout_s=10).pull(endpoint, 2, into=staged)
        folder = staged.commit(model_dir)
    assert_same(weights, random_tensors(2))
    assert (folder / STAGED_FILE).stat().st_ino == inode  # the same pages, written over
    assert area.usage() == one_version + len('{"model_type": "llama"}')
    with safe_open(str(folder / STAGED_FILE), framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "version": "2"}
        assert sorted(f.keys()) == sorted(random_tensors(2))
        assert f.get_tensor("big").tobytes() == random_tensors(2)["big"].data


async def test_a_version_that_does_not_fit_the_model_is_never_staged(tmp_path: Path) -> None:
    tensors = random_tensors(3)
    signature = signature_of(tensors)
    signature["big"] = ("float32", (7,))
    area = StagingArea(tmp_path / "staged")
    staged = area.open(3, signature)
    async with raw_learner(frames_of(list(encode_frames(3, tensors)))) as endpoint:
        weights = await GrpcWeightSource(timeout_s=10).pull(endpoint, 3, into=staged)
    with pytest.raises(WeightsError, match=r"tensor 'big' is float32\[524299\], the model needs float32\[7\]"):
        check_signature(weights, signature)
    staged.discard()
    assert list(area.root.iterdir()) == []


async def test_a_full_staging_folder_is_an_error_that_names_it_and_its_size(tmp_path: Path) -> None:
    """No room for a version (here a file-size limit; on a pod, a full /dev/shm): StagingError, not 'unreachable'."""
    tensors = random_tensors(4)
    store = WeightStore({}, keep=2)
    store.put(version_of(4, tensors))
    area = StagingArea(tmp_path / "staged")
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    async with learner(store) as endpoint:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old_limit[1]))
        try:
            with pytest.raises(
                StagingError, match=rf"cannot stage version 4 \(.* MiB\) in {tmp_path}/staged: .*GiB free"
            ):
                await GrpcWeightSource(timeout_s=10).pull(endpoint, 4, into=area.open(4, signature_of(tensors)))
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
            signal.signal(signal.SIGXFSZ, old_handler)
        weights = await GrpcWeightSource(timeout_s=10).pull(endpoint, 4, into=area.open(4, signature_of(tensors)))
    assert_same(weights, tensors)


# -- the allocator ---------------------------------------------------------------------


# The allocator's counters are process-wide, and a test worker has other
# threads (gRPC's, a previous test's) that allocate and free at any moment, so
# the checks run in a fresh interpreter whose only thread is the one checking.
ALLOCATOR_CHECK = """
import ctypes

from asymptote.codec import CHUNK_BYTES
from asymptote.rpc import reuse_freed_message_buffers


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]


reuse_freed_message_buffers()
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2


def mapped_blocks():
    return int(libc.mallinfo2().hblks)


libc.malloc_trim(0)  # the heap's free top handed back: what follows grows it
before = mapped_blocks()
message = bytearray(CHUNK_BYTES + 4096)  # a chunk and its fields
assert mapped_blocks() == before, "a message-sized buffer is mmapped"
heap = int(libc.mallinfo2().arena)
del message
assert int(libc.mallinfo2().arena) == heap, "freeing it shrinks the heap"
version = bytearray(64 << 20)  # far larger buffers are still mapped, and unmapped when freed
assert mapped_blocks() == before + 1, (before, mapped_blocks())
del version
assert mapped_blocks() == before, (before, mapped_blocks())
print("allocator checked")
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's allocator")
def test_message_sized_buffers_come_from_the_heap_and_stay_there() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ALLOCATOR_CHECK],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "allocator checked"
