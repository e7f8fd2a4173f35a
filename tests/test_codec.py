"""The weights wire format: round trips, chunk sizes, digest and every refusal."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asymptote.codec import (
    CHUNK_BYTES,
    BufferPool,
    DecodedWeights,
    WeightsDecoder,
    WireTensor,
    decode,
    encode,
    encode_frames,
    read_signature,
    split_part,
    version_digest,
)
from asymptote.contracts.v1 import tensors_pb2
from asymptote.errors import WeightsError
from tests.helpers.badinput import BAD_INPUTS

DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}
WEIGHTS = "weights"


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> WireTensor:
    """Finite random values of any wire dtype; bfloat16 as the top half of float32 words."""
    rng = np.random.default_rng(seed)
    if dtype == "bfloat16":
        words = (rng.standard_normal(size=shape).astype("<f4").view("<u4") >> 16).astype("<u2")
        return WireTensor("bfloat16", shape, words.tobytes())
    if dtype in ("int64", "int32"):
        return WireTensor.from_numpy(rng.integers(-(2**30), 2**30, size=shape).astype(dtype))
    return WireTensor.from_numpy(rng.standard_normal(size=shape).astype(dtype))


@st.composite
def tensor_dicts(draw: st.DrawFn) -> dict[str, WireTensor]:
    names = draw(
        st.lists(st.text("abcdefgh._0123456789", min_size=1, max_size=12), min_size=0, max_size=5, unique=True)
    )
    out: dict[str, WireTensor] = {}
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        itemsize = ITEMSIZE[dtype]
        kind = draw(st.sampled_from(["empty", "small", "small", "big"]))
        if kind == "empty":
            shape: tuple[int, ...] = draw(st.sampled_from([(0,), (3, 0), (0, 4, 2)]))
        elif kind == "small":
            shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=3)))
        else:
            # Just over 1 to just under 3 chunks, sometimes an exact multiple.
            num_bytes = draw(st.sampled_from([CHUNK_BYTES + itemsize, 2 * CHUNK_BYTES, 3 * CHUNK_BYTES - itemsize]))
            shape = (2, num_bytes // itemsize // 2) if num_bytes // itemsize % 2 == 0 else (num_bytes // itemsize,)
        out[name] = make_tensor(dtype, shape, draw(st.integers(0, 2**32 - 1)))
    return out


def refused(parts: list[tensors_pb2.WeightsPart], match: str | None = None) -> None:
    """The stream is refused with a WeightsError matching ``match``; recorded in the bad-input report."""
    with BAD_INPUTS.trying(WEIGHTS, [p.SerializeToString() for p in parts]), pytest.raises(WeightsError, match=match):
        decode(parts)


def chunks(parts: list[tensors_pb2.WeightsPart]) -> list[tensors_pb2.TensorChunk]:
    return [p.chunk for p in parts if p.WhichOneof("part") == "chunk"]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tensors=tensor_dicts(), version=st.integers(0, 2**63))
def test_round_trip(tensors: dict[str, WireTensor], version: int) -> None:
    parts = list(encode(version, tensors))
    assert parts[0].WhichOneof("part") == "header"
    header = parts[0].header
    assert (header.version, header.num_tensors) == (version, len(tensors))
    assert header.num_bytes == sum(len(t.data) for t in tensors.values())
    body = chunks(parts)
    assert len(body) == len(parts) - 1
    assert all(len(c.data) <= CHUNK_BYTES for c in body)
    # Name order, and each tensor in ceil(bytes / 1 MiB) chunks (one if empty).
    assert [c.name for c in body] == sorted(c.name for c in body)
    for name, t in tensors.items():
        assert sum(1 for c in body if c.name == name) == max(1, math.ceil(len(t.data) / CHUNK_BYTES))

    event(f"{sum(len(t.data) > CHUNK_BYTES for t in tensors.values())} tensors over 1 MiB")
    event(f"{sum(len(t.data) == 0 for t in tensors.values())} empty tensors")
    decoded = decode(parts)
    assert decoded.version == version
    assert decoded.digest == version_digest(tensors) == header.digest
    assert decoded.num_bytes == header.num_bytes
    assert decoded.tensors.keys() == tensors.keys()
    for name, t in tensors.items():
        got = decoded.tensors[name]
        assert (got.dtype, got.shape, got.data) == (t.dtype, t.shape, t.data)
        np.testing.assert_array_equal(got.to_numpy(), t.to_numpy())


def test_big_tensor_is_split_at_chunk_boundaries() -> None:
    t = make_tensor("float32", (CHUNK_BYTES // 4 * 2 + 5,), seed=1)
    body = chunks(list(encode(1, {"w": t})))
    assert [c.offset for c in body] == [0, CHUNK_BYTES, 2 * CHUNK_BYTES]
    assert [len(c.data) for c in body] == [CHUNK_BYTES, CHUNK_BYTES, 20]
    assert all(c.tensor_num_bytes == len(t.data) and list(c.shape) == [len(t.data) // 4] for c in body)
    assert b"".join(c.data for c in body) == t.data


# --------------------------------------------------------------------------
# Digest
# --------------------------------------------------------------------------


def test_digest_covers_names_shapes_dtypes_and_bytes() -> None:
    a = make_tensor("float32", (2, 3), seed=0)
    base = version_digest({"a": a, "b": make_tensor("int64", (4,), seed=1)})
    b = make_tensor("int64", (4,), seed=1)
    assert version_digest({"a": a, "b": b}) == base  # deterministic, independent of object identity
    assert version_digest({"b": b, "a": a}) == base  # and of insertion order
    assert version_digest({"a2": a, "b": b}) != base
    assert version_digest({"a": WireTensor("float32", (3, 2), a.data), "b": b}) != base
    assert version_digest({"a": WireTensor("int32", (2, 3), a.data), "b": b}) != base
    for i in (0, 11, len(a.data) - 1):
        flipped = bytearray(a.data)
        flipped[i] ^= 0x01
        assert version_digest({"a": WireTensor("float32", (2, 3), bytes(flipped)), "b": b}) != base


def test_digest_is_blake3_of_each_tensors_header_and_bytes_in_name_order() -> None:
    """The published definition, written out: what another implementation of the protocol computes."""
    from blake3 import blake3

    a, b = make_tensor("float32", (2, 3), seed=0), make_tensor("bfloat16", (5,), seed=1)
    want = blake3(b"a\0float32\0" + b"2,3\0" + bytes(a.data) + b"b\0bfloat16\0" + b"5\0" + bytes(b.data))
    assert version_digest({"b": b, "a": a}) == want.hexdigest()
    assert len(want.hexdigest()) == 64


# --------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------


@pytest.fixture
def stream() -> list[tensors_pb2.WeightsPart]:
    """Header, 'a' in 3 chunks, 'b' in one."""
    tensors = {
        "a": make_tensor("float32", (CHUNK_BYTES // 4 * 2 + 8,), seed=3),
        "b": make_tensor("int64", (5,), seed=4),
    }
    parts = list(encode(7, tensors))
    assert [p.chunk.name for p in parts[1:]] == ["a", "a", "a", "b"]
    decode(parts)  # intact, it is accepted
    return parts


def test_decode_refuses_a_stream_without_header(stream: list[tensors_pb2.WeightsPart]) -> None:
    refused(stream[1:], "must start with a header")
    refused([], "must start with a header")
    refused([*stream, stream[0]], "second header")


def test_decode_refuses_a_corrupted_byte(stream: list[tensors_pb2.WeightsPart]) -> None:
    data = bytearray(stream[2].chunk.data)
    data[1234] ^= 0x10
    stream[2].chunk.data = bytes(data)
    refused(stream, "digest mismatch for version 7")


def test_decode_refuses_a_missing_chunk(stream: list[tensors_pb2.WeightsPart]) -> None:
    refused(
        [stream[0], stream[1], stream[3], stream[4]], f"'a': chunk at offset {2 * CHUNK_BYTES}, expected {CHUNK_BYTES}"
    )
    refused([stream[0], stream[1], stream[2], stream[4]], f"'a': got {2 * CHUNK_BYTES} bytes of {2 * CHUNK_BYTES + 32}")
    refused(stream[:4], "header announced 2 tensors, stream held 1")


def test_decode_refuses_chunks_out_of_order(stream: list[tensors_pb2.WeightsPart]) -> None:
    refused([stream[0], stream[2], stream[1], stream[3], stream[4]], f"'a': chunk at offset {CHUNK_BYTES}, expected 0")


def test_decode_refuses_a_wrong_tensor_count(stream: list[tensors_pb2.WeightsPart]) -> None:
    stream[0].header.num_tensors = 3
    refused(stream, "header announced 3 tensors, stream held 2")


def test_decode_refuses_chunks_that_disagree(stream: list[tensors_pb2.WeightsPart]) -> None:
    stream[2].chunk.dtype = "int32"
    refused(stream, "'a': chunks disagree")


FLOAT32_BAD = {"NaN": np.float32("nan"), "+Inf": np.float32("inf"), "-Inf": np.float32("-inf")}
# Raw bfloat16 words: exponent all ones is NaN (mantissa != 0) or Inf.
BF16_BAD = {"NaN": 0x7FC0, "+Inf": 0x7F80, "-Inf": 0xFF80, "negative NaN": 0xFFC1}


@pytest.mark.parametrize("label", list(FLOAT32_BAD))
def test_decode_refuses_non_finite_float32(label: str) -> None:
    array = np.ones((3, 4), dtype=np.float32)
    array[2, 1] = FLOAT32_BAD[label]
    parts = list(encode(1, {"good": make_tensor("float32", (4,), 0), "bad": WireTensor.from_numpy(array)}))
    refused(parts, "'bad' holds NaN or Inf")


@pytest.mark.parametrize("label", list(BF16_BAD))
def test_decode_refuses_non_finite_bfloat16(label: str) -> None:
    # 1.0, -2.0, 65280 (largest-exponent finite values) and a subnormal are all fine.
    words = np.array([0x3F80, 0xC000, 0x7F7F, 0x0001], dtype="<u2")
    parts = list(encode(1, {"w": WireTensor("bfloat16", (4,), words.tobytes())}))
    assert decode(parts).tensors["w"].data == words.tobytes()
    words[2] = BF16_BAD[label]
    parts = list(encode(1, {"w": WireTensor("bfloat16", (4,), words.tobytes())}))
    refused(parts, "'w' holds NaN or Inf")


def test_decode_refuses_non_finite_float16() -> None:
    array = np.array([1.0, np.inf], dtype=np.float16)
    refused(list(encode(1, {"h": WireTensor.from_numpy(array)})), "holds NaN or Inf")


def test_integers_are_not_checked_for_finiteness() -> None:
    words = np.array([0x7FC0, 0x7F80], dtype=np.int32)
    decoded = decode(list(encode(1, {"i": WireTensor.from_numpy(words)})))
    assert decoded.tensors["i"].to_numpy().tolist() == [0x7FC0, 0x7F80]


# --------------------------------------------------------------------------
# WireTensor and signatures
# --------------------------------------------------------------------------


def test_wire_tensor_refuses_a_wrong_byte_length() -> None:
    with pytest.raises(WeightsError, match=r"dtype float32 and shape \[2, 3\] needs 24 bytes, got 23"):
        WireTensor("float32", (2, 3), bytes(23))
    with pytest.raises(WeightsError, match="needs 0 bytes, got 2"):
        WireTensor("bfloat16", (0, 5), bytes(2))


def test_wire_tensor_refuses_an_unknown_dtype() -> None:
    with pytest.raises(WeightsError, match=r"unsupported dtype 'complex64'.*accepted: .*'bfloat16'"):
        WireTensor("complex64", (1,), bytes(8))
    with pytest.raises(WeightsError, match="unsupported dtype 'uint8'"):
        WireTensor.from_numpy(np.zeros(3, dtype=np.uint8))


def test_wire_tensor_numpy_round_trip_is_little_endian() -> None:
    big_endian = np.array([1.5, -2.0], dtype=">f4")
    t = WireTensor.from_numpy(big_endian)
    assert t.data == np.array([1.5, -2.0], dtype="<f4").tobytes()
    np.testing.assert_array_equal(t.to_numpy(), [1.5, -2.0])


def test_read_signature(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(
        {
            "model.embed.weight": np.zeros((16, 8), dtype=np.float32),
            "model.norm.weight": np.zeros((8,), dtype=np.float16),
        },
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"lm_head.weight": np.zeros((16, 8), dtype=np.float64), "step": np.zeros((), dtype=np.int64)},
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    (tmp_path / "config.json").write_text("{}")
    assert read_signature(tmp_path) == {
        "model.embed.weight": ("float32", (16, 8)),
        "model.norm.weight": ("float16", (8,)),
        "lm_head.weight": ("float64", (16, 8)),
        "step": ("int64", ()),
    }


def test_read_signature_without_weights(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match=r"no \*\.safetensors"):
        read_signature(tmp_path)


# --------------------------------------------------------------------------
# Serialized frames and the streaming decoder
# --------------------------------------------------------------------------


def reference_decode(parts: list[tensors_pb2.WeightsPart]) -> tuple[int, str, dict[str, WireTensor]]:
    """The obvious reassembly of an intact stream: each tensor's chunk bytes joined, hashed by ``digest``."""
    header = parts[0].header
    data: dict[str, list[bytes]] = {}
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for p in parts[1:]:
        data.setdefault(p.chunk.name, []).append(p.chunk.data)
        meta[p.chunk.name] = (p.chunk.dtype, tuple(p.chunk.shape))
    tensors = {name: WireTensor(*meta[name], b"".join(chunks)) for name, chunks in data.items()}
    return int(header.version), version_digest(tensors), tensors


SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@SETTINGS
@given(tensors=tensor_dicts(), version=st.integers(0, 2**63))
def test_frames_are_the_serialized_parts(tensors: dict[str, WireTensor], version: int) -> None:
    parts = list(encode(version, tensors))
    frames = list(encode_frames(version, tensors))
    assert frames == [p.SerializeToString() for p in parts]
    assert [tensors_pb2.WeightsPart.FromString(f) for f in frames] == parts


def joined(part: tensors_pb2.WeightsPart, data: memoryview | None) -> tensors_pb2.WeightsPart:
    """``split_part``'s answer as one message: the part with a chunk's data put back."""
    whole = tensors_pb2.WeightsPart()
    whole.CopyFrom(part)
    if data is not None:
        whole.chunk.data = bytes(data)
    return whole


def split_or_refused(frame: bytes) -> tensors_pb2.WeightsPart | None:
    try:
        return joined(*split_part(frame))
    except DecodeError:
        return None


def parsed_or_refused(frame: bytes) -> tensors_pb2.WeightsPart | None:
    try:
        return tensors_pb2.WeightsPart.FromString(frame)
    except DecodeError:
        return None


@SETTINGS
@given(tensors=tensor_dicts(), version=st.integers(0, 2**63))
def test_a_split_frame_is_what_protobuf_parses_and_its_data_views_the_frame(
    tensors: dict[str, WireTensor], version: int
) -> None:
    for frame in encode_frames(version, tensors):
        part, data = split_part(frame)
        assert joined(part, data) == tensors_pb2.WeightsPart.FromString(frame)
        if part.WhichOneof("part") == "chunk" and data is not None:
            assert data.obj is frame and not part.chunk.data  # a view of the received bytes, not a copy
            assert data.tobytes() == tensors_pb2.WeightsPart.FromString(frame).chunk.data
        else:  # the header, and an empty tensor's chunk (its data field left out): parsed whole
            assert data is None


def test_frames_laid_out_otherwise_split_as_protobuf_parses_them() -> None:
    chunk = tensors_pb2.TensorChunk(name="w", dtype="float32", shape=[2], offset=0, tensor_num_bytes=8)
    meta = chunk.SerializeToString()
    data_first = tensors_pb2.TensorChunk(data=b"\x01" * 8).SerializeToString() + meta
    twice = meta + tensors_pb2.TensorChunk(data=b"\x02" * 8).SerializeToString() * 2  # the last one counts
    frames = [
        tensors_pb2.WeightsPart(chunk=tensors_pb2.TensorChunk.FromString(data_first)).SerializeToString(),
        tensors_pb2.WeightsPart(chunk=chunk).SerializeToString()[:2] + data_first,  # a length that lies
        b"\x12" + bytes([len(twice)]) + twice,
        tensors_pb2.WeightsPart(chunk=chunk).SerializeToString() * 2,  # two chunk fields: merged
        tensors_pb2.WeightsPart(header=tensors_pb2.WeightsHeader(version=3)).SerializeToString(),
        tensors_pb2.TensorDelta(name="w").SerializeToString(),
    ]
    for frame in frames:
        assert split_or_refused(frame) == parsed_or_refused(frame), frame


@SETTINGS
@given(tensors=tensor_dicts(), data=st.data())
def test_a_cut_or_changed_frame_splits_exactly_when_protobuf_parses_it(
    tensors: dict[str, WireTensor], data: st.DataObject
) -> None:
    frames = list(encode_frames(2, tensors))
    frame = frames[data.draw(st.integers(0, len(frames) - 1), label="frame")]
    cut = frame[: data.draw(st.integers(0, len(frame)), label="bytes kept")]
    at = data.draw(st.integers(0, max(len(frame) - 1, 0)), label="byte changed")
    changed = frame[:at] + bytes([data.draw(st.integers(0, 255), label="to")]) + frame[at + 1 :]
    noise = data.draw(st.binary(max_size=64), label="noise")
    for f in (cut, changed, noise):
        assert split_or_refused(f) == parsed_or_refused(f)


@SETTINGS
@given(tensors=tensor_dicts())
def test_decoding_split_frames_is_bit_identical_to_decoding_parts(tensors: dict[str, WireTensor]) -> None:
    with WeightsDecoder() as decoder:
        for frame in encode_frames(4, tensors):
            decoder.feed(*split_part(frame))
        got = decoder.finish()
    assert (got.version, got.digest) == (4, version_digest(tensors))
    assert {n: bytes(t.data) for n, t in got.tensors.items()} == {n: bytes(t.data) for n, t in tensors.items()}


@SETTINGS
@given(tensors=tensor_dicts())
def test_streaming_decode_is_bit_identical_to_the_reference(tensors: dict[str, WireTensor]) -> None:
    parts = list(encode(5, tensors))
    version, digest, expected = reference_decode(parts)
    with WeightsDecoder() as decoder:
        for part in parts:
            decoder.feed(part)
        got = decoder.finish()
    assert (got.version, got.digest) == (version, digest) == (5, version_digest(tensors))
    assert list(got.tensors) == sorted(tensors)
    for name, t in expected.items():
        g = got.tensors[name]
        assert (
            (g.dtype, g.shape, bytes(g.data))
            == (t.dtype, t.shape, t.data)
            == (tensors[name].dtype, tensors[name].shape, tensors[name].data)
        )
        assert g.to_numpy().tobytes() == tensors[name].to_numpy().tobytes()


@SETTINGS
@given(tensors=tensor_dicts(), data=st.data())
def test_every_truncated_stream_is_refused(tensors: dict[str, WireTensor], data: st.DataObject) -> None:
    parts = list(encode(1, tensors))
    cut = data.draw(st.integers(0, len(parts) - 1), label="parts kept")
    refused(parts[:cut])
    # A last chunk cut short is refused too.
    last = parts[-1].chunk
    if last.data:
        keep = data.draw(st.integers(0, len(last.data) - 1), label="bytes kept")
        short = tensors_pb2.WeightsPart()
        short.CopyFrom(parts[-1])
        short.chunk.data = last.data[:keep]
        refused([*parts[:-1], short], f"got {last.offset + keep} bytes of {last.tensor_num_bytes}")


@SETTINGS
@given(tensors=tensor_dicts(), data=st.data())
def test_every_flipped_bit_is_refused_as_a_digest_mismatch(tensors: dict[str, WireTensor], data: st.DataObject) -> None:
    parts = list(encode(3, tensors))
    with_data = [i for i, p in enumerate(parts) if p.WhichOneof("part") == "chunk" and p.chunk.data]
    if not with_data:
        return
    i = data.draw(st.sampled_from(with_data), label="chunk")
    flipped = bytearray(parts[i].chunk.data)
    at = data.draw(st.integers(0, len(flipped) - 1), label="byte")
    flipped[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    parts[i].chunk.data = bytes(flipped)
    # Reported as corruption even where the flip made a NaN or Inf.
    refused(parts, "digest mismatch for version 3")


@SETTINGS
@given(tensors=tensor_dicts(), data=st.data())
def test_every_swap_of_two_parts_is_refused_when_it_arrives(
    tensors: dict[str, WireTensor], data: st.DataObject
) -> None:
    parts = list(encode(1, tensors))
    if len(parts) < 3:
        return
    i = data.draw(st.integers(0, len(parts) - 2), label="first")
    j = data.draw(st.integers(i + 1, len(parts) - 1), label="second")
    parts[i], parts[j] = parts[j], parts[i]
    fed = parts[: j + 1]  # refused by the time the second swapped part has arrived
    with (
        BAD_INPUTS.trying(WEIGHTS, [p.SerializeToString() for p in fed]),
        WeightsDecoder() as decoder,
        pytest.raises(WeightsError),
    ):
        for part in fed:
            decoder.feed(part)


def test_the_report_counts_each_distinct_bad_stream_once(stream: list[tensors_pb2.WeightsPart]) -> None:
    # Tensor 'b' with one of its first 16 bits flipped: no other test sends these.
    corrupted = []
    for bit in range(16):
        flipped = bytearray(stream[4].chunk.data)
        flipped[bit // 8] ^= 1 << bit % 8
        part = tensors_pb2.WeightsPart()
        part.CopyFrom(stream[4])
        part.chunk.data = bytes(flipped)
        corrupted.append([*stream[:4], part])
    before = BAD_INPUTS.num_tried(WEIGHTS)
    for parts in corrupted + corrupted:
        refused(parts, "digest mismatch for version 7")
    assert BAD_INPUTS.num_tried(WEIGHTS) == before + len(corrupted)


def test_decoder_refuses_a_chunk_out_of_order_as_it_arrives(stream: list[tensors_pb2.WeightsPart]) -> None:
    with WeightsDecoder() as decoder:
        decoder.feed(stream[0])
        decoder.feed(stream[1])
        with pytest.raises(WeightsError, match=f"'a': chunk at offset {2 * CHUNK_BYTES}, expected {CHUNK_BYTES}"):
            decoder.feed(stream[3])


def test_decoder_refuses_tensors_out_of_name_order_or_twice() -> None:
    tensors = {"a": make_tensor("float32", (3,), 0), "b": make_tensor("float32", (2,), 1)}
    header, a, b = encode(1, tensors)
    refused([header, b, a], "tensor 'a' arrived after 'b': tensors come once each, in name order")
    refused([header, a, b, a], "tensor 'a' arrived after 'b'")


def test_decoder_refuses_a_chunk_past_its_tensor(stream: list[tensors_pb2.WeightsPart]) -> None:
    stream[4].chunk.data += b"\0" * 8
    refused(stream, "'b': got 48 bytes of 40")


def test_decoder_refuses_sizes_that_disagree_with_the_header_or_the_shape(
    stream: list[tensors_pb2.WeightsPart],
) -> None:
    total = stream[0].header.num_bytes
    stream[0].header.num_bytes = total - 1
    refused(stream, f"tensor 'b' does not fit in the {total - 1} bytes the header announced")
    stream[0].header.num_bytes = total + 8
    refused(stream, f"header announced {total + 8} bytes, stream held {total}")
    stream[0].header.num_bytes = 2**62
    refused(stream, f"header announced {2**62} bytes, more than can be held")
    stream[0].header.num_bytes = total
    stream[4].chunk.shape[:] = [6]
    refused(stream, "'b' of dtype int64 and shape \\[6\\] needs 48 bytes, chunks announce 40")


def test_decoder_refuses_an_unknown_dtype_and_an_empty_part(stream: list[tensors_pb2.WeightsPart]) -> None:
    bad = [*stream]
    bad[4] = tensors_pb2.WeightsPart()
    bad[4].CopyFrom(stream[4])
    bad[4].chunk.dtype = "complex64"
    refused(bad, "'b': unsupported dtype 'complex64'")
    refused([*stream, tensors_pb2.WeightsPart()], "empty part")


def test_decoded_tensors_are_views_into_one_buffer(stream: list[tensors_pb2.WeightsPart]) -> None:
    weights = decode(stream)
    a, b = weights.tensors["a"], weights.tensors["b"]
    assert isinstance(a.data, memoryview) and isinstance(b.data, memoryview)
    assert bytes(a.data) == b"".join(p.chunk.data for p in stream[1:4])
    assert bytes(b.data) == stream[4].chunk.data
    start = np.frombuffer(a.data, dtype=np.uint8).ctypes.data
    assert np.frombuffer(b.data, dtype=np.uint8).ctypes.data == start + len(a.data)  # back to back, name order


def test_wire_tensor_takes_a_flat_byte_view_only() -> None:
    words = np.arange(6, dtype="<f4")
    t = WireTensor("float32", (2, 3), memoryview(words.tobytes()))
    np.testing.assert_array_equal(t.to_numpy(), words.reshape(2, 3))
    with pytest.raises(WeightsError, match="flat byte memoryview, got format 'f'"):
        WireTensor("float32", (6,), words.data)


def test_an_abandoned_decoder_stops_its_worker(stream: list[tensors_pb2.WeightsPart]) -> None:
    def workers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("weights-verify")]

    before = workers()
    with pytest.raises(WeightsError), WeightsDecoder() as decoder:
        for part in [stream[0], stream[1], stream[3]]:
            decoder.feed(part)
    assert workers() == before
    decode(stream)
    assert workers() == before


def test_a_pooled_buffer_is_written_again_only_once_nothing_views_it() -> None:
    def version(seed: int) -> list[tensors_pb2.WeightsPart]:
        return list(
            encode(
                seed,
                {"a": make_tensor("float32", (CHUNK_BYTES // 4 + 3,), seed), "b": make_tensor("bfloat16", (40,), seed)},
            )
        )

    def address(weights: DecodedWeights) -> int:
        return int(np.frombuffer(weights.tensors["a"].data, dtype=np.uint8).ctypes.data)

    pool = BufferPool()

    def pull(parts: list[tensors_pb2.WeightsPart]) -> DecodedWeights:
        with WeightsDecoder(pool) as decoder:
            for part in parts:
                decoder.feed(part)
            return decoder.finish()

    first = pull(version(1))
    at = address(first)
    still_used = first.tensors["a"].to_numpy()  # one array viewing the version outlives it
    expected = still_used.copy()
    del first
    second = pull(version(2))
    assert address(second) != at
    np.testing.assert_array_equal(still_used, expected)  # never overwritten while viewed

    del still_used  # nothing views the first version's buffer now: the next pull writes into it
    third = pull(version(3))
    assert address(third) == at
    assert third.digest == version_digest(reference_decode(version(3))[2])
    assert bytes(third.tensors["a"].data) == make_tensor("float32", (CHUNK_BYTES // 4 + 3,), 3).data
    assert bytes(second.tensors["a"].data) == make_tensor("float32", (CHUNK_BYTES // 4 + 3,), 2).data

    # A refused stream gives its buffer back too.
    del third
    corrupted = version(4)
    corrupted[1].chunk.data = b"\xff" * 8 + corrupted[1].chunk.data[8:]
    with pytest.raises(WeightsError, match="digest mismatch"):
        pull(corrupted)
    assert address(pull(version(5))) == at
