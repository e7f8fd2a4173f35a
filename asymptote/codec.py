"""Tensor codec: named tensors <-> 1 MiB protobuf chunks, with a digest.

Owns the wire format of weights (ARCHITECTURE "Contracts"): tensors travel
as ``TensorChunk{name, dtype, shape, offset, data}`` of at most
``CHUNK_BYTES``, in name order, after one ``WeightsHeader`` carrying the
version's sha256. Works on numpy arrays (torch-free); bfloat16 travels as
its raw 2-byte words under the dtype name "bfloat16".

The digest covers, for each tensor in name order, its name, dtype, shape
and bytes, so a renamed or reshaped tensor changes it too.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asymptote.contracts.v1 import tensors_pb2
from asymptote.errors import WeightsError

CHUNK_BYTES = 1 << 20
"""Chunk size: gRPC rejects messages over 4 MiB by default (server side)."""

# Wire dtype name -> numpy dtype of the raw bytes.
_WIRE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # raw bf16 words; the consumer reinterprets
    "float64": np.dtype("<f8"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64", "I32": "int32"}

Signature = dict[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (wire dtype, shape): what a model's weights must look like."""


@dataclass(frozen=True)
class WireTensor:
    """A tensor as it travels: dtype name, shape and little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in _WIRE_DTYPES:
            raise WeightsError(f"unsupported dtype {self.dtype!r}; accepted: {sorted(_WIRE_DTYPES)}")
        expected = math.prod(self.shape) * _WIRE_DTYPES[self.dtype].itemsize
        if len(self.data) != expected:
            raise WeightsError(
                f"tensor of dtype {self.dtype} and shape {list(self.shape)} needs {expected} bytes, got {len(self.data)}"
            )

    @classmethod
    def from_numpy(cls, array: np.ndarray, dtype: str | None = None) -> "WireTensor":
        name = dtype or array.dtype.name
        arr = np.ascontiguousarray(array, dtype=_WIRE_DTYPES[name] if name in _WIRE_DTYPES else None)
        return cls(name, tuple(int(d) for d in array.shape), arr.tobytes())

    def to_numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=_WIRE_DTYPES[self.dtype]).reshape(self.shape)


def digest(tensors: Mapping[str, WireTensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}\0{t.dtype}\0{','.join(map(str, t.shape))}\0".encode())
        h.update(t.data)
    return h.hexdigest()


def encode(version: int, tensors: Mapping[str, WireTensor], sha256: str | None = None) -> Iterator[tensors_pb2.WeightsPart]:
    """Frame a version as one header then ≤1 MiB chunks in name order."""
    yield tensors_pb2.WeightsPart(
        header=tensors_pb2.WeightsHeader(
            version=version,
            num_tensors=len(tensors),
            num_bytes=sum(len(t.data) for t in tensors.values()),
            sha256=sha256 or digest(tensors),
        )
    )
    for name in sorted(tensors):
        t = tensors[name]
        view = memoryview(t.data)
        offsets = range(0, max(len(t.data), 1), CHUNK_BYTES)
        for offset in offsets:
            yield tensors_pb2.WeightsPart(
                chunk=tensors_pb2.TensorChunk(
                    name=name,
                    dtype=t.dtype,
                    shape=t.shape,
                    offset=offset,
                    tensor_num_bytes=len(t.data),
                    data=bytes(view[offset : offset + CHUNK_BYTES]),
                )
            )


@dataclass(frozen=True)
class DecodedWeights:
    version: int
    sha256: str
    tensors: dict[str, WireTensor]

    @property
    def num_bytes(self) -> int:
        return sum(len(t.data) for t in self.tensors.values())


def decode(parts: Iterable[tensors_pb2.WeightsPart]) -> DecodedWeights:
    """Reassemble a framed version and verify it; raises WeightsError.

    Checks: a header first, chunks contiguous and consistent per tensor,
    the announced counts and byte total, the sha256, and that floating
    tensors hold no NaN or Inf.
    """
    it = iter(parts)
    first = next(it, None)
    if first is None or first.WhichOneof("part") != "header":
        raise WeightsError("weights stream must start with a header")
    header = first.header
    buffers: dict[str, bytearray] = {}
    meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for part in it:
        if part.WhichOneof("part") != "chunk":
            raise WeightsError("weights stream holds a second header")
        c = part.chunk
        shape = tuple(int(d) for d in c.shape)
        if c.name not in buffers:
            buffers[c.name] = bytearray()
            meta[c.name] = (c.dtype, shape, c.tensor_num_bytes)
        elif meta[c.name] != (c.dtype, shape, c.tensor_num_bytes):
            raise WeightsError(f"tensor {c.name!r}: chunks disagree on dtype, shape or size")
        buf = buffers[c.name]
        if c.offset != len(buf):
            raise WeightsError(f"tensor {c.name!r}: chunk at offset {c.offset}, expected {len(buf)}")
        buf.extend(c.data)
    tensors: dict[str, WireTensor] = {}
    for name, buf in buffers.items():
        dtype, shape, size = meta[name]
        if len(buf) != size:
            raise WeightsError(f"tensor {name!r}: got {len(buf)} bytes of {size}")
        tensors[name] = WireTensor(dtype, shape, bytes(buf))
    if len(tensors) != header.num_tensors:
        raise WeightsError(f"header announced {header.num_tensors} tensors, stream held {len(tensors)}")
    actual = digest(tensors)
    if actual != header.sha256:
        raise WeightsError(f"sha256 mismatch for version {header.version}: header {header.sha256[:12]}…, data {actual[:12]}…")
    check_finite(tensors)
    return DecodedWeights(int(header.version), actual, tensors)


def check_finite(tensors: Mapping[str, WireTensor]) -> None:
    for name, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            continue
        arr = t.to_numpy()
        if t.dtype == "bfloat16":
            # bf16 is the top half of a float32: exponent all ones = Inf/NaN.
            bad = bool(((arr & 0x7F80) == 0x7F80).any())
        else:
            bad = not bool(np.isfinite(arr).all())
        if bad:
            raise WeightsError(f"tensor {name!r} holds NaN or Inf")


PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})
"""Weight files whose formats unpickle (can run code) when loaded: never loaded."""


def safetensors_files(folder: Path) -> list[Path]:
    """The ``*.safetensors`` files of a weights folder; WeightsError when it has none.

    Weights are read from safetensors only: a folder holding only
    pickle-based files (``pytorch_model.bin``, ``*.pt``, ...) is refused,
    and such files beside safetensors ones are ignored, never unpickled.
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*") if p.suffix in PICKLE_SUFFIXES)
        found = f"; refusing {', '.join(pickled[:5])} (pickle-based weights are never loaded)" if pickled else ""
        raise WeightsError(f"no *.safetensors in {folder}: weights load from safetensors only{found}")
    return files


def read_signature(model_dir: Path) -> Signature:
    """Tensor name -> (dtype, shape) of the model the engine was built from."""
    from safetensors import safe_open

    signature: Signature = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype().lower())
                signature[name] = (dtype, tuple(int(d) for d in sl.get_shape()))
    return signature
