"""Host memory for the versions the learner serves: page-locked on a GPU, reused once nothing reads it.

Owns ``HostBuffers``. A copy between GPU and pageable host memory goes
through the driver's bounce buffers and each waits for the host: an H200
copied to the device at 5.8 GB/s from pageable memory against 54.5 GB/s
from page-locked (docs/benchmarks.md, "The learner on one GPU"). Into
page-locked buffers a version's copies queue on the stream with one wait
at the end; at 8B that would be about 0.3 s instead of 2.5 s on the step's
path each version.

Locking pages is slow (the kernel pins each one), so a buffer is locked
once, sized for a whole version, and reused. A version's tensors are
segments of one buffer, and each segment reaches the wire as a memoryview
of a ctypes array over its bytes: the buffer is free again when every such
view and every slice of one is gone, i.e. when the store has dropped the
version and no pull still streams it. A buffer is ordinary host memory
registered with CUDA (``cudaHostRegister``), exactly a version's bytes,
where torch's pinned allocator would round it up to a power of two (a
16.1 GB version to 32 GiB).

Does not copy; ``services.learner.weights.to_wire`` copies into the
segments.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

ALIGN_BYTES = 64
"""Each segment starts on a 64-byte boundary (every dtype's alignment, and a cache line)."""


def aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class Segment:
    """One tensor's bytes in a version's buffer."""

    host: torch.Tensor
    """The bytes as a flat uint8 tensor, to copy into."""
    data: memoryview
    """The same bytes, for the wire tensor; the buffer is reused only when this and its slices are gone."""


class _Buffer:
    def __init__(self, num_bytes: int) -> None:
        self.bytes = torch.empty(num_bytes, dtype=torch.uint8)
        self.readers = 0
        """Segments handed out whose views are still alive."""


class HostBuffers:
    """Buffers for whole versions, page-locked when ``pin`` (a CUDA build), reused when no reader is left.

    Thread-safe: the step thread leases, and any thread may drop the last
    view of a segment.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._buffers: list[_Buffer] = []
        # Reentrant: a collection inside a leasing thread's critical section can drop a view's last reference,
        # and its finalizer releases under this lock.
        self._lock = threading.RLock()

    @classmethod
    def for_device(cls, device: torch.device) -> HostBuffers | None:
        """Page-locked buffers for a learner on a GPU; None on the CPU (a copy there is a memcpy either way)."""
        return cls(pin=True) if device.type == "cuda" else None

    @property
    def num_bytes(self) -> int:
        """Host memory the buffers hold, in use or free."""
        with self._lock:
            return sum(b.bytes.numel() for b in self._buffers)

    @property
    def num_buffers(self) -> int:
        with self._lock:
            return len(self._buffers)

    @property
    def num_free(self) -> int:
        with self._lock:
            return sum(1 for b in self._buffers if b.readers == 0)

    def lease(self, sizes: Sequence[int]) -> list[Segment]:
        """Segments of ``sizes`` bytes, in order, in one buffer: a free one that fits, else a new one."""
        offsets, total = [], 0
        for size in sizes:
            if size < 0:
                raise ValueError(f"a segment of {size} bytes")
            offsets.append(total)
            total += aligned(size)
        with self._lock:
            fits = [b for b in self._buffers if b.readers == 0 and b.bytes.numel() >= total]
            buffer = min(fits, key=lambda b: b.bytes.numel()) if fits else None
            if buffer is None:
                buffer = self._allocate(max(total, 1))
                self._buffers.append(buffer)
            buffer.readers = len(sizes)
        base = buffer.bytes.data_ptr()
        segments = []
        for offset, size in zip(offsets, sizes, strict=True):
            view = (ctypes.c_ubyte * size).from_address(base + offset)
            weakref.finalize(view, self._release, buffer)
            segments.append(Segment(buffer.bytes[offset : offset + size], memoryview(view).cast("B")))
        return segments

    def _allocate(self, num_bytes: int) -> _Buffer:
        buffer = _Buffer(num_bytes)
        if self.pin:
            err = torch.cuda.cudart().cudaHostRegister(buffer.bytes.data_ptr(), num_bytes, 0)
            if int(err) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of {num_bytes / 1e9:.2f} GB for a served version failed (error {int(err)}): "
                    f"the learner's locked-memory limit (ulimit -l) or the host's memory is too small"
                )
            log.info("page-locked %.2f GB of host memory for served versions", num_bytes / 1e9)
        return buffer

    def _release(self, buffer: _Buffer) -> None:
        with self._lock:
            buffer.readers -= 1
