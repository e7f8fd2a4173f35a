"""The weights wire format: round trips, chunk sizes, digest and every refusal."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asymptote.codec import CHUNK_BYTES, WireTensor, decode, digest, encode, read_signature
from asymptote.contracts.v1 import tensors_pb2
from asymptote.errors import WeightsError

DTYPES = ("float32", "float16", "int64")


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> WireTensor:
    rng = np.random.default_rng(seed)
    if dtype == "int64":
        array = rng.integers(-(2**40), 2**40, size=shape, dtype=np.int64)
    else:
        array = rng.standard_normal(size=shape).astype(dtype)
    return WireTensor.from_numpy(array)


@st.composite
def tensor_dicts(draw: st.DrawFn) -> dict[str, WireTensor]:
    names = draw(st.lists(st.text("abcdefgh._0123456789", min_size=1, max_size=12), min_size=0, max_size=5, unique=True))
    out: dict[str, WireTensor] = {}
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        itemsize = np.dtype(dtype).itemsize
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
    assert decoded.sha256 == digest(tensors) == header.sha256
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
    base = digest({"a": a, "b": make_tensor("int64", (4,), seed=1)})
    b = make_tensor("int64", (4,), seed=1)
    assert digest({"a": a, "b": b}) == base  # deterministic, independent of object identity
    assert digest({"b": b, "a": a}) == base  # and of insertion order
    assert digest({"a2": a, "b": b}) != base
    assert digest({"a": WireTensor("float32", (3, 2), a.data), "b": b}) != base
    assert digest({"a": WireTensor("int32", (2, 3), a.data), "b": b}) != base
    for i in (0, 11, len(a.data) - 1):
        flipped = bytearray(a.data)
        flipped[i] ^= 0x01
        assert digest({"a": WireTensor("float32", (2, 3), bytes(flipped)), "b": b}) != base


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
    with pytest.raises(WeightsError, match="must start with a header"):
        decode(stream[1:])
    with pytest.raises(WeightsError, match="must start with a header"):
        decode([])
    with pytest.raises(WeightsError, match="second header"):
        decode([*stream, stream[0]])


def test_decode_refuses_a_corrupted_byte(stream: list[tensors_pb2.WeightsPart]) -> None:
    data = bytearray(stream[2].chunk.data)
    data[1234] ^= 0x10
    stream[2].chunk.data = bytes(data)
    with pytest.raises(WeightsError, match="sha256 mismatch for version 7"):
        decode(stream)


def test_decode_refuses_a_missing_chunk(stream: list[tensors_pb2.WeightsPart]) -> None:
    with pytest.raises(WeightsError, match=f"'a': chunk at offset {2 * CHUNK_BYTES}, expected {CHUNK_BYTES}"):
        decode([stream[0], stream[1], stream[3], stream[4]])
    with pytest.raises(WeightsError, match=f"'a': got {2 * CHUNK_BYTES} bytes of {2 * CHUNK_BYTES + 32}"):
        decode([stream[0], stream[1], stream[2], stream[4]])
    with pytest.raises(WeightsError, match="header announced 2 tensors, stream held 1"):
        decode(stream[:4])


def test_decode_refuses_chunks_out_of_order(stream: list[tensors_pb2.WeightsPart]) -> None:
    with pytest.raises(WeightsError, match=f"'a': chunk at offset {CHUNK_BYTES}, expected 0"):
        decode([stream[0], stream[2], stream[1], stream[3], stream[4]])


def test_decode_refuses_a_wrong_tensor_count(stream: list[tensors_pb2.WeightsPart]) -> None:
    stream[0].header.num_tensors = 3
    with pytest.raises(WeightsError, match="header announced 3 tensors, stream held 2"):
        decode(stream)


def test_decode_refuses_chunks_that_disagree(stream: list[tensors_pb2.WeightsPart]) -> None:
    stream[2].chunk.dtype = "int32"
    with pytest.raises(WeightsError, match="'a': chunks disagree"):
        decode(stream)


FLOAT32_BAD = {"NaN": np.float32("nan"), "+Inf": np.float32("inf"), "-Inf": np.float32("-inf")}
# Raw bfloat16 words: exponent all ones is NaN (mantissa != 0) or Inf.
BF16_BAD = {"NaN": 0x7FC0, "+Inf": 0x7F80, "-Inf": 0xFF80, "negative NaN": 0xFFC1}


@pytest.mark.parametrize("label", list(FLOAT32_BAD))
def test_decode_refuses_non_finite_float32(label: str) -> None:
    array = np.ones((3, 4), dtype=np.float32)
    array[2, 1] = FLOAT32_BAD[label]
    parts = list(encode(1, {"good": make_tensor("float32", (4,), 0), "bad": WireTensor.from_numpy(array)}))
    with pytest.raises(WeightsError, match="'bad' holds NaN or Inf"):
        decode(parts)


@pytest.mark.parametrize("label", list(BF16_BAD))
def test_decode_refuses_non_finite_bfloat16(label: str) -> None:
    # 1.0, -2.0, 65280 (largest-exponent finite values) and a subnormal are all fine.
    words = np.array([0x3F80, 0xC000, 0x7F7F, 0x0001], dtype="<u2")
    parts = list(encode(1, {"w": WireTensor("bfloat16", (4,), words.tobytes())}))
    assert decode(parts).tensors["w"].data == words.tobytes()
    words[2] = BF16_BAD[label]
    parts = list(encode(1, {"w": WireTensor("bfloat16", (4,), words.tobytes())}))
    with pytest.raises(WeightsError, match="'w' holds NaN or Inf"):
        decode(parts)


def test_decode_refuses_non_finite_float16() -> None:
    array = np.array([1.0, np.inf], dtype=np.float16)
    with pytest.raises(WeightsError, match="holds NaN or Inf"):
        decode(list(encode(1, {"h": WireTensor.from_numpy(array)})))


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
    with pytest.raises(WeightsError, match="unsupported dtype 'complex64'.*accepted: .*'bfloat16'"):
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
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        read_signature(tmp_path)
