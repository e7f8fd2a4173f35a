"""Where a new version waits for its swap (``worker_ext.choose_placement``).

The GPU branch reads the device's free memory; no GPU runs here, so the
three CUDA memory queries are faked (free memory, what the caching
allocator reserved and what it hands out). The copies themselves run in
``python -m benchmarks.gpu`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from services.generator.worker_ext import DEVICE_RESERVE_BYTES, choose_placement

GIB = 1 << 30
CUDA = torch.device("cuda", 0)


def fake_gpu(monkeypatch: pytest.MonkeyPatch, free: int, reserved: int = 0, allocated: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def test_the_cpu_computes_from_the_mapped_pages_whatever_was_asked() -> None:
    for asked in ("auto", "mapped", "pinned", "device"):
        assert choose_placement(asked, torch.device("cpu"), 10 * GIB) == "mapped"


def test_auto_takes_the_device_only_when_the_version_fits_with_the_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    version = 16 * GIB
    fake_gpu(monkeypatch, free=version + DEVICE_RESERVE_BYTES)
    assert choose_placement("auto", CUDA, version) == "device"
    fake_gpu(monkeypatch, free=version + DEVICE_RESERVE_BYTES - 1)
    assert choose_placement("auto", CUDA, version) == "pinned"
    # Memory the caching allocator holds but has not handed out is free for the staging too.
    fake_gpu(monkeypatch, free=8 * GIB, reserved=12 * GIB, allocated=3 * GIB)
    assert choose_placement("auto", CUDA, version) == "device"
    fake_gpu(monkeypatch, free=8 * GIB, reserved=12 * GIB, allocated=4 * GIB)
    assert choose_placement("auto", CUDA, version) == "pinned"


def test_an_explicit_place_is_taken_on_a_gpu_and_a_bad_one_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, free=0)
    assert choose_placement("device", CUDA, GIB) == "device"  # asked for: the engine's memory is the user's call
    assert choose_placement("pinned", CUDA, GIB) == "pinned"
    assert choose_placement("mapped", CUDA, GIB) == "mapped"
    with pytest.raises(ValueError, match=r"swap staging 'disk': expected auto, mapped, pinned, device"):
        choose_placement("disk", CUDA, GIB)
