"""Host buffers for served versions: laid out per version, reused only once no reader is left.

Page-locking (``cudaHostRegister``) needs a CUDA build: here the buffers are
ordinary memory (``pin=False``), the same code otherwise; the page-locked
copy is measured by ``python -m benchmarks.gpu`` on a GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch

from asymptote.codec import decode, encode
from services.learner.host_buffers import ALIGN_BYTES, HostBuffers, aligned
from services.learner.weights import WeightStore, to_wire

SIGNATURE = {
    "a.weight": ("bfloat16", (5, 3)),
    "b.bias": ("float32", (7,)),
    "c.empty": ("float32", (0,)),
}


def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(shape, generator=g)) for n, (_, shape) in SIGNATURE.items()]


def test_a_version_is_laid_out_in_one_buffer_each_tensor_aligned() -> None:
    buffers = HostBuffers(pin=False)
    segments = buffers.lease([30, 28, 0, 64])
    assert [s.host.numel() for s in segments] == [len(s.data) for s in segments] == [30, 28, 0, 64]
    starts = [s.host.data_ptr() for s in segments]
    assert all((p - starts[0]) % ALIGN_BYTES == 0 for p in starts)
    assert buffers.num_bytes == aligned(30) + aligned(28) + 0 + 64 == 192
    segments[1].host.copy_(torch.arange(28, dtype=torch.uint8))
    assert bytes(segments[1].data) == bytes(range(28))  # the wire's view is the bytes copied in
    assert buffers.num_free == 0


def test_a_buffer_is_reused_only_when_every_view_and_slice_is_gone() -> None:
    buffers = HostBuffers(pin=False)
    first = buffers.lease([100, 50])
    ptr = first[0].host.data_ptr()
    streaming = first[1].data[10:20]  # a pull still sending part of the version
    del first
    gc.collect()
    second = buffers.lease([100, 50])
    assert second[0].host.data_ptr() != ptr and buffers.num_bytes == 2 * (aligned(100) + aligned(50))
    del streaming
    assert buffers.num_free == 1
    third = buffers.lease([100, 50])
    assert third[0].host.data_ptr() == ptr  # the first buffer again, nothing new allocated
    assert buffers.num_bytes == 2 * (aligned(100) + aligned(50)) and buffers.num_free == 0
    del second, third
    assert buffers.num_free == 2


def test_served_through_buffers_a_version_is_the_same_bytes_and_digest() -> None:
    buffers = HostBuffers(pin=False)
    plain = WeightStore(SIGNATURE, keep=2)
    reused = WeightStore(SIGNATURE, keep=2, host_buffers=buffers)
    for version in range(1, 7):
        a = plain.snapshot_tensors(version, tensors(version))
        b = reused.snapshot_tensors(version, tensors(version))
        assert b.digest == a.digest
        assert {n: bytes(t.data) for n, t in b.tensors.items()} == {n: bytes(t.data) for n, t in a.tensors.items()}
        decoded = decode(encode(version, b.tensors, b.digest))
        assert decoded.digest == a.digest
    # Two versions kept, one being staged at most: the buffers of dropped versions were reused.
    assert buffers.num_buffers <= 3
    held = reused.get(5)
    assert held is not None and held.digest == plain.get(5).digest  # type: ignore[union-attr]


def test_a_tensor_that_does_not_fit_its_segment_is_refused() -> None:
    segment = HostBuffers(pin=False).lease([8])[0]
    with pytest.raises(ValueError, match="a 12-byte tensor into a segment of 8 bytes"):
        to_wire(torch.zeros(3), "float32", into=segment)


def test_only_a_gpu_learner_locks_pages() -> None:
    assert HostBuffers.for_device(torch.device("cpu")) is None
    buffers = HostBuffers.for_device(torch.device("cuda", 0))
    assert buffers is not None and buffers.pin
