"""Weight deltas: a version sent as the elements that changed since a version the receiver holds.

Owns the delta's wire format (``TensorDelta`` in tensors.proto) and both
directions. Between two optimizer steps most served-dtype elements are
bit-identical (a bf16 word changes only when the float32 master weight
crosses a rounding boundary), so a delta lists, per window of a tensor, the
positions of the changed elements and their new values. Elements compare
as raw words, so a delta rebuilds the version bit for bit (signed zeros and
NaN payloads included).

A window covers ``CHUNK_BYTES`` of a tensor's elements (the full version's
chunk grid), so no part exceeds the wire's chunk size by more than a few
fields. Each window picks the smallest of three encodings of its positions
(all decode with a few numpy calls):

- gaps: one LEB128 varint per change, its distance from the previous change
  minus one (about a byte per change when fewer than 1 in 128 change);
- mask: one bit per element (an eighth of a byte per element, whatever
  changed: smaller once more than about 1 in 8 change);
- dense: the window's elements whole (when most changed).

Windows with no change are not sent. The receiver writes each window in
place into its copy of the base (``DeltaDecoder``) and then verifies the
whole rebuilt version against the header's digest exactly as a full pull is
verified, so a wrong base, a lost window or a corrupted byte is refused.
Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from asymptote.codec import (
    CHUNK_BYTES,
    BufferSource,
    DecodedWeights,
    ReceivedDelta,
    Signature,
    WireTensor,
    is_finite,
    signature_num_bytes,
    tensor_views,
    version_digest,
    wire_dtype,
)
from asymptote.contracts.v1 import tensors_pb2
from asymptote.errors import StagingError, WeightsError

GAPS = tensors_pb2.DELTA_ENCODING_GAPS
MASK = tensors_pb2.DELTA_ENCODING_MASK
DENSE = tensors_pb2.DELTA_ENCODING_DENSE
ENCODING_NAMES = {GAPS: "gaps", MASK: "mask", DENSE: "dense"}
_MAX_VARINT_BYTES = 4
"""A window holds at most 2^19 elements of a 2-byte dtype, so a gap needs at most 3 varint bytes."""


def words(t: WireTensor) -> np.ndarray:
    """A tensor's elements as unsigned words of their size: equal words are bit-identical elements."""
    return np.frombuffer(t.data, dtype=f"<u{wire_dtype(t.dtype).itemsize}")


def window_elements(dtype: str) -> int:
    """Elements of ``dtype`` in one window: a chunk's bytes."""
    return max(1, CHUNK_BYTES // wire_dtype(dtype).itemsize)


# --------------------------------------------------------------------------
# Positions
# --------------------------------------------------------------------------


def encode_gaps(positions: np.ndarray) -> bytes:
    """Strictly increasing ``positions`` as LEB128 varints of (distance from the previous one) - 1."""
    if len(positions) == 0:
        return b""
    gaps = np.diff(positions.astype(np.int64), prepend=-1) - 1
    sizes = np.ones(len(gaps), dtype=np.int64)
    for k in range(1, 10):
        big = gaps >= (1 << (7 * k))
        if not big.any():
            break
        sizes += big
    offsets = np.cumsum(sizes) - sizes
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    for j in range(int(sizes.max())):
        has = sizes > j
        byte = (gaps[has] >> (7 * j)) & 0x7F
        more = sizes[has] > j + 1
        out[offsets[has] + j] = (byte | (more.astype(np.int64) << 7)).astype(np.uint8)
    return out.tobytes()


def decode_gaps(data: bytes, num_elements: int) -> np.ndarray:
    """The positions ``encode_gaps`` wrote; WeightsError unless they are well formed and < ``num_elements``."""
    b = np.frombuffer(data, dtype=np.uint8)
    if len(b) == 0:
        return np.empty(0, dtype=np.int64)
    if b[-1] & 0x80:
        raise WeightsError("delta positions end inside a varint")
    ends = np.flatnonzero(b < 0x80)
    lengths = np.diff(ends, prepend=-1)
    if int(lengths.max()) > _MAX_VARINT_BYTES:
        raise WeightsError(f"delta position varint longer than {_MAX_VARINT_BYTES} bytes")
    starts = ends - lengths + 1
    shifts = 7 * (np.arange(len(b)) - np.repeat(starts, lengths))
    gaps = np.add.reduceat((b & 0x7F).astype(np.int64) << shifts, starts)
    positions = np.cumsum(gaps + 1) - 1
    if positions[-1] >= num_elements:
        raise WeightsError(f"delta position {int(positions[-1])} is outside its window of {num_elements} elements")
    return positions


def decode_mask(data: bytes, num_elements: int) -> np.ndarray:
    """The set bits of a little-endian bitmask over ``num_elements``."""
    if len(data) != (num_elements + 7) // 8:
        raise WeightsError(f"delta mask of {len(data)} bytes for a window of {num_elements} elements")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=num_elements, bitorder="little")
    return np.flatnonzero(bits)


# --------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------


@dataclass
class DeltaStats:
    """What a delta holds: elements compared and changed, and its bytes by encoding."""

    num_elements: int = 0
    num_changed: int = 0
    num_bytes: int = 0
    """Payload bytes (positions and values) of the windows sent."""
    bytes_by_encoding: dict[str, int] = field(default_factory=lambda: {name: 0 for name in ENCODING_NAMES.values()})
    windows_by_encoding: dict[str, int] = field(default_factory=lambda: {name: 0 for name in ENCODING_NAMES.values()})

    @property
    def changed_fraction(self) -> float:
        return self.num_changed / self.num_elements if self.num_elements else 0.0


def encode_window(name: str, start: int, old: np.ndarray, new: np.ndarray) -> tensors_pb2.TensorDelta | None:
    """The changes from ``old`` to ``new`` (one window's words), in its smallest encoding; None if none changed."""
    positions = np.flatnonzero(old != new)
    if len(positions) == 0:
        return None
    n, itemsize = len(new), new.dtype.itemsize
    values = len(positions) * itemsize
    gaps = encode_gaps(positions)
    sizes = {GAPS: len(gaps) + values, MASK: (n + 7) // 8 + values, DENSE: n * itemsize}
    encoding = min(sizes, key=lambda e: (sizes[e], e))
    delta = tensors_pb2.TensorDelta(name=name, start=start, num_elements=n, encoding=encoding)
    if encoding == DENSE:
        delta.values = new.tobytes()
        return delta
    delta.positions = gaps if encoding == GAPS else np.packbits(old != new, bitorder="little").tobytes()
    delta.values = new[positions].tobytes()
    return delta


def encode_delta(
    base: Mapping[str, WireTensor], target: Mapping[str, WireTensor], stats: DeltaStats | None = None
) -> Iterator[tensors_pb2.TensorDelta]:
    """The windows of ``target`` that differ from ``base``, in name and element order.

    The two must hold the same tensor names, dtypes and shapes (ValueError naming the first that differs).
    """
    if sorted(base) != sorted(target):
        raise ValueError(f"a delta needs the same tensors: base has {len(base)}, target {len(target)}")
    for name in sorted(target):
        b, t = base[name], target[name]
        if (b.dtype, b.shape) != (t.dtype, t.shape):
            raise ValueError(f"tensor {name!r} is {b.dtype}{list(b.shape)} in the base, {t.dtype}{list(t.shape)} now")
        old, new = words(b), words(t)
        step = window_elements(t.dtype)
        for start in range(0, len(new), step):
            delta = encode_window(name, start, old[start : start + step], new[start : start + step])
            if stats is not None:
                n = min(step, len(new) - start)
                stats.num_elements += n
            if delta is None:
                continue
            if stats is not None:
                payload = len(delta.positions) + len(delta.values)
                kind = ENCODING_NAMES[delta.encoding]
                stats.num_changed += n if delta.encoding == DENSE else len(delta.values) // new.dtype.itemsize
                stats.num_bytes += payload
                stats.bytes_by_encoding[kind] += payload
                stats.windows_by_encoding[kind] += 1
            yield delta


def delta_frames(
    version: int,
    target: Mapping[str, WireTensor],
    digest: str,
    base_version: int,
    base: Mapping[str, WireTensor],
    base_digest: str,
    stats: DeltaStats | None = None,
) -> list[bytes]:
    """``version`` as a serialized stream of changes since ``base_version``: a header, then the windows."""
    header = tensors_pb2.WeightsHeader(
        version=version,
        num_tensors=len(target),
        num_bytes=sum(len(t.data) for t in target.values()),
        digest=digest or version_digest(target),
        base_version=base_version,
        base_digest=base_digest,
    )
    frames = [tensors_pb2.WeightsPart(header=header).SerializeToString()]
    frames += [tensors_pb2.WeightsPart(delta=d).SerializeToString() for d in encode_delta(base, target, stats)]
    return frames


# --------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------


class DeltaDecoder:
    """Rebuild a version from a delta, in place over the base's bytes, and verify it.

    ``buffers.take`` must hand back the version ``header.base_version`` with
    digest ``header.base_digest``, laid out as ``signature`` (name order, back
    to back: a staged file's data section); the caller vouches for that.
    Feed the delta's parts in order after the header: each is checked as it
    arrives and kept (a delta is small). ``finish`` then takes the base,
    writes every window into it and hashes the whole version (run it off
    the event loop), so a stream cut short leaves the base untouched.
    Raises WeightsError at the first malformed window (unknown tensor, out
    of order, out of bounds, or positions and values that disagree) and, in
    ``finish``, when the rebuilt bytes do not hash to the header's digest or
    hold NaN/Inf; the base is gone then, to be written over by a full pull.
    """

    def __init__(
        self, header: tensors_pb2.WeightsHeader, signature: Signature, buffers: BufferSource, base_digest: str
    ) -> None:
        if header.base_digest != base_digest:
            raise WeightsError(
                f"delta for version {header.version} is from a base with digest {header.base_digest[:12]}…, "
                f"the base held has {base_digest[:12]}…"
            )
        num_bytes = signature_num_bytes(signature)
        if header.num_bytes != num_bytes or header.num_tensors != len(signature):
            raise WeightsError(
                f"delta for version {header.version} announces {header.num_tensors} tensors of {header.num_bytes} "
                f"bytes; the model has {len(signature)} of {num_bytes}"
            )
        self.header = header
        self.signature = signature
        self._buffers = buffers
        self._sizes = {
            name: (math.prod(shape), wire_dtype(dtype).itemsize) for name, (dtype, shape) in signature.items()
        }
        self._windows: list[tuple[str, int, np.ndarray | None, bytes]] = []
        self._last: tuple[str, int] | None = None

    def feed(self, part: tensors_pb2.WeightsPart) -> None:
        kind = part.WhichOneof("part")
        if kind != "delta":
            raise WeightsError(f"a delta stream holds a {kind or 'empty part'} after its header")
        self._check(part.delta)

    def _check(self, d: tensors_pb2.TensorDelta) -> None:
        if d.name not in self._sizes:
            raise WeightsError(f"delta names tensor {d.name!r}, which the model does not have")
        key = (d.name, int(d.start))
        if self._last is not None and key <= self._last:
            raise WeightsError(f"delta window {key} arrived after {self._last}: windows come once each, in order")
        self._last = key
        num_elements, itemsize = self._sizes[d.name]
        start, n = int(d.start), int(d.num_elements)
        if n < 1 or n * itemsize > max(CHUNK_BYTES, itemsize) or start + n > num_elements:
            raise WeightsError(f"tensor {d.name!r}: delta window [{start}, {start + n}) of {num_elements} elements")
        if d.encoding == DENSE:
            if len(d.values) != n * itemsize or d.positions:
                raise WeightsError(f"tensor {d.name!r}: dense delta window of {n} elements holds {len(d.values)} bytes")
            self._windows.append((d.name, start, None, d.values))
            return
        if d.encoding == GAPS:
            positions = decode_gaps(d.positions, n)
        elif d.encoding == MASK:
            positions = decode_mask(d.positions, n)
        else:
            raise WeightsError(f"tensor {d.name!r}: unknown delta encoding {d.encoding}")
        if len(d.values) != len(positions) * itemsize or len(positions) == 0:
            raise WeightsError(
                f"tensor {d.name!r}: delta window names {len(positions)} changes and holds {len(d.values)} bytes"
            )
        self._windows.append((d.name, start, positions, d.values))

    def finish(self, frames: tuple[bytes, ...] = ()) -> DecodedWeights:
        """The rebuilt version, verified; ``frames``: the delta as received, kept to serve it on."""
        tensors = tensor_views(self._buffers.take(signature_num_bytes(self.signature)), self.signature)
        for name, start, positions, values in self._windows:
            target = words(tensors[name])
            window = np.frombuffer(tensors[name].data, dtype=target.dtype)[start:]
            new = np.frombuffer(values, dtype=target.dtype)
            if positions is None:
                window[: len(new)] = new
            else:
                window[positions] = new
        actual = version_digest(tensors)
        if actual != self.header.digest:
            raise WeightsError(
                f"digest mismatch for version {self.header.version} rebuilt from delta on version "
                f"{self.header.base_version}: header {self.header.digest[:12]}…, data {actual[:12]}…"
            )
        for name, t in tensors.items():
            if not is_finite(t):
                raise WeightsError(f"tensor {name!r} holds NaN or Inf")
        received = ReceivedDelta(int(self.header.base_version), self.header.base_digest, frames)
        return DecodedWeights(int(self.header.version), actual, tensors, received)


def apply_delta(frames: list[bytes], signature: Signature, base: np.ndarray, base_digest: str) -> DecodedWeights:
    """Rebuild a version from serialized delta ``frames`` over ``base`` (written in place); see DeltaDecoder."""

    class _Base:
        def take(self, num_bytes: int) -> np.ndarray:
            if num_bytes != len(base):
                raise StagingError(f"a base of {len(base)} bytes for a version of {num_bytes}")
            return base

    parts = [tensors_pb2.WeightsPart.FromString(f) for f in frames]
    if not parts or parts[0].WhichOneof("part") != "header":
        raise WeightsError("weights stream must start with a header")
    decoder = DeltaDecoder(parts[0].header, signature, _Base(), base_digest)
    for part in parts[1:]:
        decoder.feed(part)
    return decoder.finish(tuple(frames))
