"""Tensor codec: named tensors <-> 1 MiB protobuf chunks, with a digest.

Owns the wire format of weights (docs/architecture.md, "Streams, subjects and RPCs"): tensors travel
as ``TensorChunk{name, dtype, shape, offset, data}`` of at most
``CHUNK_BYTES``, in name order, after one ``WeightsHeader`` carrying the
version's digest. Works on numpy arrays (torch-free); bfloat16 travels as
its raw 2-byte words under the dtype name "bfloat16".

The digest is BLAKE3 (hex) over, for each tensor in name order, its name,
dtype, shape and bytes, so a renamed or reshaped tensor changes it too.
BLAKE3 hashes several times faster than sha256 on one core and spreads a
large update over several (``hasher``): a learner serving a version every
step and a generator checking each pull both hash every byte.

Both directions avoid copying weights more than the wire needs:
``encode_frames`` gives each part already serialized (a chunk's bytes are
copied once, into its frame), and ``WeightsDecoder`` checks a stream as it
arrives, writing each chunk in place into one buffer for the whole version
and hashing it there while the next chunk is received.
"""

from __future__ import annotations

import json
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self

import numpy as np
from blake3 import blake3

from asymptote.contracts.v1 import tensors_pb2
from asymptote.errors import StagingError, WeightsError
from asymptote.wire import fields, length_delimited_key, varint

CHUNK_BYTES = 1 << 20
"""Chunk size: gRPC rejects messages over 4 MiB by default (server side)."""
HASH_BYTES = 8 << 20
"""Bytes a decoder writes before it queues them for hashing: a few chunks a hash update, each a fixed cost
(BLAKE3 over 1 MiB updates measured 1.7x the time of one update over the same bytes)."""

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
_SAFETENSORS_DTYPES = {
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
}

_SAFETENSORS_CODES = {wire: code for code, wire in _SAFETENSORS_DTYPES.items()}

Signature = dict[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (wire dtype, shape): what a model's weights must look like."""


def tensor_num_bytes(dtype: str, shape: Sequence[int]) -> int:
    """The bytes of one tensor of ``dtype`` (a wire dtype) and ``shape``."""
    return math.prod(shape) * _WIRE_DTYPES[dtype].itemsize


def signature_num_bytes(signature: Signature) -> int:
    """The bytes of one version of a model with this signature."""
    return sum(tensor_num_bytes(dtype, shape) for dtype, shape in signature.values())


def safetensors_header(signature: Signature, metadata: Mapping[str, str], min_bytes: int = 0) -> bytes:
    """The header of a safetensors file holding ``signature``'s tensors back to back in name order.

    Name order is the wire's order, so a decoded version's buffer is exactly
    this file's data section: the length prefix, then the JSON padded with
    spaces to a multiple of 8 bytes (the format's alignment of the data),
    and to at least ``min_bytes`` in all (so headers whose metadata differ
    in length can put the data at the same offset).
    """
    entries: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in sorted(signature):
        dtype, shape = signature[name]
        end = offset + tensor_num_bytes(dtype, shape)
        entries[name] = {"dtype": _SAFETENSORS_CODES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * max(-(len(body) + 8) % 8, min_bytes - 8 - len(body))
    body += b" " * (-(len(body) + 8) % 8)
    return len(body).to_bytes(8, "little") + body


@dataclass(frozen=True)
class WireTensor:
    """A tensor as it travels: dtype name, shape and little-endian bytes.

    ``data`` is ``bytes`` or a flat byte ``memoryview``; a decoded tensor
    holds a view into its version's buffer (see WeightsDecoder).
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    def __post_init__(self) -> None:
        if self.dtype not in _WIRE_DTYPES:
            raise WeightsError(f"unsupported dtype {self.dtype!r}; accepted: {sorted(_WIRE_DTYPES)}")
        if isinstance(self.data, memoryview) and (self.data.format != "B" or self.data.ndim != 1):
            raise WeightsError(f"tensor data must be bytes or a flat byte memoryview, got format {self.data.format!r}")
        expected = tensor_num_bytes(self.dtype, self.shape)
        if len(self.data) != expected:
            raise WeightsError(
                f"tensor of dtype {self.dtype} and shape {list(self.shape)} needs {expected} bytes, got {len(self.data)}"
            )

    @classmethod
    def from_numpy(cls, array: np.ndarray, dtype: str | None = None) -> WireTensor:
        name = dtype or array.dtype.name
        arr = np.ascontiguousarray(array, dtype=_WIRE_DTYPES[name] if name in _WIRE_DTYPES else None)
        return cls(name, tuple(int(d) for d in array.shape), arr.tobytes())

    def to_numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=_WIRE_DTYPES[self.dtype]).reshape(self.shape)


def _digest_prefix(name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    """What the digest reads before a tensor's bytes."""
    return f"{name}\0{dtype}\0{','.join(map(str, shape))}\0".encode()


def tensor_views(buffer: np.ndarray, signature: Signature) -> dict[str, WireTensor]:
    """``signature``'s tensors laid out back to back in name order in ``buffer`` (a version's bytes), as views."""
    tensors: dict[str, WireTensor] = {}
    offset = 0
    for name in sorted(signature):
        dtype, shape = signature[name]
        size = tensor_num_bytes(dtype, shape)
        tensors[name] = WireTensor(dtype, shape, buffer.data[offset : offset + size])
        offset += size
    return tensors


def wire_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a wire dtype's raw elements (bfloat16: its 2-byte words)."""
    return _WIRE_DTYPES[dtype]


def hasher() -> blake3:
    """A new BLAKE3 hasher for a version's digest, free to use every core on a large update."""
    return blake3(max_threads=blake3.AUTO)


def version_digest(tensors: Mapping[str, WireTensor], new: Callable[[], Any] = hasher) -> str:
    """The digest of a version: its tensors' names, dtypes, shapes and bytes in name order.

    ``new``: the hash (a hashlib-style constructor); BLAKE3, the protocol's, unless a benchmark compares.
    """
    h = new()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(_digest_prefix(name, t.dtype, t.shape))
        h.update(t.data)
    hexdigest: str = h.hexdigest()
    return hexdigest


# --------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------


def _header(version: int, tensors: Mapping[str, WireTensor], digest: str | None) -> tensors_pb2.WeightsPart:
    return tensors_pb2.WeightsPart(
        header=tensors_pb2.WeightsHeader(
            version=version,
            num_tensors=len(tensors),
            num_bytes=sum(len(t.data) for t in tensors.values()),
            digest=digest or version_digest(tensors),
        )
    )


def _chunks(tensors: Mapping[str, WireTensor]) -> Iterator[tuple[tensors_pb2.TensorChunk, memoryview]]:
    """Each chunk in wire order: its fields but ``data``, and the bytes ``data`` holds."""
    for name in sorted(tensors):
        t = tensors[name]
        view = memoryview(t.data)
        # An empty tensor still travels as one (empty) chunk, so it is announced.
        for offset in range(0, max(len(view), 1), CHUNK_BYTES):
            meta = tensors_pb2.TensorChunk(
                name=name, dtype=t.dtype, shape=t.shape, offset=offset, tensor_num_bytes=len(view)
            )
            yield meta, view[offset : offset + CHUNK_BYTES]


def encode(
    version: int, tensors: Mapping[str, WireTensor], digest: str | None = None
) -> Iterator[tensors_pb2.WeightsPart]:
    """Frame a version as one header then ≤1 MiB chunks in name order."""
    yield _header(version, tensors, digest)
    for meta, data in _chunks(tensors):
        meta.data = bytes(data)
        yield tensors_pb2.WeightsPart(chunk=meta)


_CHUNK_FIELD = tensors_pb2.WeightsPart.DESCRIPTOR.fields_by_name["chunk"].number
_DATA_FIELD = tensors_pb2.TensorChunk.DESCRIPTOR.fields_by_name["data"].number
_CHUNK_KEY = length_delimited_key(_CHUNK_FIELD)
_DATA_KEY = length_delimited_key(_DATA_FIELD)


def encode_frames(version: int, tensors: Mapping[str, WireTensor], digest: str | None = None) -> Iterator[bytes]:
    """``encode``'s parts, serialized: the same bytes ``SerializeToString`` gives.

    A chunk's small fields are serialized by protobuf and its ``data``
    field (the last field number, where protobuf puts it) is appended by
    hand, so the weights are copied once, into the frame, instead of into
    a message and again into its serialization.
    """
    yield _header(version, tensors, digest).SerializeToString()
    for meta, data in _chunks(tensors):
        fields = meta.SerializeToString()
        # An empty data field is left out, as protobuf leaves out proto3 fields at their default.
        data_field = (_DATA_KEY, varint(len(data))) if len(data) else ()
        size = len(fields) + sum(map(len, data_field)) + len(data)
        yield b"".join((_CHUNK_KEY, varint(size), fields, *data_field, data))


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------


def split_part(frame: bytes) -> tuple[tensors_pb2.WeightsPart, memoryview | None]:
    """A received frame as its part, and a chunk's data as a view of ``frame``, never copied.

    A frame that is one chunk holding one ``data`` field (what
    ``encode_frames`` writes) gives the chunk's other fields, parsed by
    protobuf, and its data as a view; any other frame is parsed whole
    (data None: a chunk's data is then the part's own). Either way the part
    and data are what ``WeightsPart.FromString(frame)`` holds, and a frame
    that is not a part raises protobuf's DecodeError.
    """
    view = memoryview(frame)
    try:
        outer = list(fields(view))
        if len(outer) == 1 and outer[0].number == _CHUNK_FIELD and outer[0].length_delimited:
            chunk = view[outer[0].start : outer[0].end]
            data = [f for f in fields(chunk) if f.number == _DATA_FIELD]
            if len(data) == 1 and data[0].length_delimited:
                d = data[0]
                rest = b"".join((chunk[: d.key_start], chunk[d.end :]))
                part = tensors_pb2.WeightsPart(chunk=tensors_pb2.TensorChunk.FromString(rest))
                return part, chunk[d.start : d.end]
    except ValueError:
        pass  # not laid out as a chunk frame: protobuf's parse says what is wrong with it
    return tensors_pb2.WeightsPart.FromString(frame), None


@dataclass(frozen=True)
class ReceivedDelta:
    """How a version arrived as a delta: its base, and the frames as received (to serve them on)."""

    base_version: int
    base_digest: str
    frames: tuple[bytes, ...]

    @property
    def num_bytes(self) -> int:
        return sum(map(len, self.frames))


@dataclass(frozen=True)
class DecodedWeights:
    version: int
    digest: str
    tensors: dict[str, WireTensor]
    delta: ReceivedDelta | None = None
    """Set when the version was rebuilt from a delta onto a version held before."""

    @property
    def num_bytes(self) -> int:
        return sum(len(t.data) for t in self.tensors.values())


def _new_buffer(num_bytes: int) -> np.ndarray:
    # numpy (unlike bytearray) asks the kernel for huge pages on large
    # buffers, which makes first-touching them several times cheaper.
    return np.empty(num_bytes, dtype=np.uint8)


class BufferSource(Protocol):
    """Where a decoder writes a version: one writable buffer of the header's byte total."""

    def take(self, num_bytes: int) -> np.ndarray:
        """A writable uint8 buffer of ``num_bytes``; WeightsError, MemoryError or ValueError if refused."""
        ...


class BufferPool:
    """Keeps a decoded version's buffer for the next version, once nothing views it.

    Writing a version into fresh memory makes the kernel fault in and zero
    every page of it first (measured: about half the CPU of hashing it). A
    buffer taken from the pool is handed out as a view (its lease); the
    decoded tensors view the lease, so when the last of them is gone the
    buffer comes back, and the next version that fits is written into it.
    A buffer something still views is never handed out again. Holds at
    most one spare buffer, so a process pulling versions keeps about one
    version's worth of memory between pulls.
    """

    def __init__(self) -> None:
        self._spare: np.ndarray | None = None
        # Leases end in whichever thread drops the last view.
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> np.ndarray:
        """A writable buffer of ``num_bytes``; MemoryError (or ValueError) if it cannot be had."""
        with self._lock:
            spare, self._spare = self._spare, None
        buffer = spare if spare is not None and len(spare) >= num_bytes else _new_buffer(num_bytes)
        lease = buffer[:num_bytes]
        weakref.finalize(lease, self._give_back, buffer)
        return lease

    def _give_back(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._spare = buffer


@dataclass
class _Incoming:
    """The tensor whose chunks are arriving."""

    name: str
    meta: tuple[str, tuple[int, ...], int]  # dtype, shape, byte size, as its first chunk announced
    view: memoryview  # its slice of the version's buffer
    filled: int = 0
    hashed: int = 0  # bytes of it queued for hashing


class WeightsDecoder:
    """Reassemble and verify a weights stream part by part, as it arrives.

    ``feed`` the parts in order, then ``finish`` once; use it as a context
    manager (or call ``close``) so its worker thread stops when a stream is
    abandoned. Each chunk's bytes are written in place into one buffer sized
    by the header's byte total (from ``buffers`` when given) and hashed
    there (the stream's order is the digest's order), and each tensor is
    scanned for NaN/Inf once complete.
    ``feed`` raises WeightsError at the first part whose framing is wrong (no
    header first, a second header, a chunk out of order, missing, running
    past its tensor or disagreeing on dtype, shape or size, tensors out of
    name order or beyond the announced bytes); ``finish`` raises it for an
    incomplete last tensor, the announced counts, the digest and non-finite
    values, in that order, so corrupted bytes are reported as such even
    when the corruption made a NaN.
    """

    def __init__(self, buffers: BufferSource | None = None) -> None:
        self._buffers = buffers
        self._header: tensors_pb2.WeightsHeader | None = None
        self._buffer = np.empty(0, dtype=np.uint8)
        self._num_used = 0  # bytes of the buffer handed to tensors so far
        self._hash = hasher()
        self._tensors: dict[str, WireTensor] = {}
        self._incoming: _Incoming | None = None
        # digest and the NaN/Inf scans release the GIL, so a worker runs them
        # on bytes already in place while the caller receives the next chunk.
        # One worker: it hashes in submission order, the digest's order.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-verify")
        self._hashed: list[Future[object]] = []
        self._finite: list[tuple[str, Future[bool]]] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the verifying worker, dropping work not yet started; ``finish`` does it too."""
        self._worker.shutdown(wait=True, cancel_futures=True)

    def feed(self, part: tensors_pb2.WeightsPart, data: memoryview | None = None) -> None:
        """The next part; ``data``: a chunk's bytes when they are not the part's own (``split_part``)."""
        kind = part.WhichOneof("part")
        if self._header is None:
            if kind != "header":
                raise WeightsError("weights stream must start with a header")
            self._start(part.header)
            return
        if kind != "chunk":
            raise WeightsError(
                "weights stream holds a second header" if kind == "header" else "weights stream holds an empty part"
            )
        self._place(part.chunk, part.chunk.data if data is None else data)

    def _place(self, c: tensors_pb2.TensorChunk, data: bytes | memoryview) -> None:
        """Write chunk ``c`` (its bytes ``data``) into its tensor's place; queue hashing what is written."""
        meta = (c.dtype, tuple(int(d) for d in c.shape), int(c.tensor_num_bytes))
        t = self._incoming
        if t is None or c.name != t.name:
            t = self._open(c.name, meta)
        elif meta != t.meta:
            raise WeightsError(f"tensor {c.name!r}: chunks disagree on dtype, shape or size")
        if c.offset != t.filled:
            raise WeightsError(f"tensor {c.name!r}: chunk at offset {c.offset}, expected {t.filled}")
        end = t.filled + len(data)
        if end > len(t.view):
            raise WeightsError(f"tensor {c.name!r}: got {end} bytes of {len(t.view)}")
        t.view[t.filled : end] = data
        t.filled = end
        if t.filled - t.hashed >= HASH_BYTES:
            self._hash_written(t)

    def _hash_written(self, t: _Incoming) -> None:
        """Queue hashing the bytes of ``t`` written since its last hashing."""
        if t.filled > t.hashed:
            self._hashed.append(self._worker.submit(self._hash.update, t.view[t.hashed : t.filled]))
            t.hashed = t.filled

    def finish(self) -> DecodedWeights:
        """The verified version; WeightsError if the stream was incomplete or is refused."""
        header = self._header
        if header is None:
            raise WeightsError("weights stream must start with a header")
        try:
            self._close()
        except WeightsError:
            self.close()
            raise
        self._worker.shutdown(wait=True)  # all queued hashing and scans run before their results are read
        for future in self._hashed:
            future.result()
        if len(self._tensors) != header.num_tensors:
            raise WeightsError(f"header announced {header.num_tensors} tensors, stream held {len(self._tensors)}")
        if self._num_used != header.num_bytes:
            raise WeightsError(f"header announced {header.num_bytes} bytes, stream held {self._num_used}")
        actual = self._hash.hexdigest()
        if actual != header.digest:
            raise WeightsError(
                f"digest mismatch for version {header.version}: header {header.digest[:12]}…, data {actual[:12]}…"
            )
        for name, finite in self._finite:
            if not finite.result():
                raise WeightsError(f"tensor {name!r} holds NaN or Inf")
        return DecodedWeights(int(header.version), actual, self._tensors)

    def _start(self, header: tensors_pb2.WeightsHeader) -> None:
        self._header = header
        try:
            n = header.num_bytes
            self._buffer = self._buffers.take(n) if self._buffers is not None else _new_buffer(n)
        except (WeightsError, StagingError):
            raise
        except (MemoryError, ValueError) as exc:
            raise WeightsError(f"header announced {header.num_bytes} bytes, more than can be held: {exc}") from exc

    def _open(self, name: str, meta: tuple[str, tuple[int, ...], int]) -> _Incoming:
        """Start the next tensor, after closing the one before it."""
        previous = self._incoming.name if self._incoming is not None else None
        self._close()
        if previous is not None and name <= previous:
            raise WeightsError(f"tensor {name!r} arrived after {previous!r}: tensors come once each, in name order")
        dtype, shape, size = meta
        if dtype not in _WIRE_DTYPES:
            raise WeightsError(f"tensor {name!r}: unsupported dtype {dtype!r}; accepted: {sorted(_WIRE_DTYPES)}")
        expected = tensor_num_bytes(dtype, shape)
        if any(d < 0 for d in shape) or size != expected:
            raise WeightsError(
                f"tensor {name!r} of dtype {dtype} and shape {list(shape)} needs {expected} bytes, chunks announce {size}"
            )
        if self._num_used + size > len(self._buffer):
            raise WeightsError(f"tensor {name!r} does not fit in the {len(self._buffer)} bytes the header announced")
        self._hashed.append(self._worker.submit(self._hash.update, _digest_prefix(name, dtype, shape)))
        view = self._buffer.data[self._num_used : self._num_used + size]
        self._num_used += size
        self._incoming = _Incoming(name, meta, view)
        return self._incoming

    def _close(self) -> None:
        """Check the incoming tensor is complete and keep it."""
        t = self._incoming
        if t is None:
            return
        self._incoming = None
        if t.filled != len(t.view):
            raise WeightsError(f"tensor {t.name!r}: got {t.filled} bytes of {len(t.view)}")
        self._hash_written(t)
        dtype, shape, _ = t.meta
        tensor = WireTensor(dtype, shape, t.view)
        self._tensors[t.name] = tensor
        self._finite.append((t.name, self._worker.submit(is_finite, tensor)))


def decode(parts: Iterable[tensors_pb2.WeightsPart]) -> DecodedWeights:
    """Reassemble a framed version and verify it; raises WeightsError (see WeightsDecoder)."""
    with WeightsDecoder() as decoder:
        for part in parts:
            decoder.feed(part)
        return decoder.finish()


def is_finite(t: WireTensor) -> bool:
    """Whether a float tensor holds no NaN or Inf (other dtypes: always)."""
    if t.dtype not in FLOAT_DTYPES:
        return True
    arr = t.to_numpy()
    if t.dtype == "bfloat16":
        # bf16 is the top half of a float32: exponent all ones = Inf/NaN.
        return not bool(((arr & 0x7F80) == 0x7F80).any())
    return bool(np.isfinite(arr).all())


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


def count_stored_parameters(model_dir: Path) -> int:
    """Parameters stored in a model directory's safetensors files (a tied head once)."""
    return sum(math.prod(shape) for _, shape in read_signature(model_dir).values())
