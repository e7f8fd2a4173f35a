"""Pulling, verifying and staging policy weights on a generator.

Owns the weight-source seam: ``GrpcWeightSource`` pulls a version from the
learner's ``Learner.PullWeights`` stream (a peer-to-peer tree or NCCL
transfer would implement the same ``pull``). Every update is checked before
it reaches the engine: sha256, tensor names, shapes and dtypes against the
model the engine was built from, and NaN/Inf. A refused update raises
WeightsError and the engine keeps the version it has. Staged versions are
written as safetensors (never pickle) under a tmpfs folder, straight from
the verified bytes (no copy of the tensors on the way).
"""

from __future__ import annotations

import ctypes
import logging
import platform
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from asymptote.codec import BufferPool, DecodedWeights, Signature, WeightsDecoder, WireTensor
from asymptote.config import TlsSettings
from asymptote.contracts.v1 import services_pb2, services_pb2_grpc
from asymptote.errors import WeightsError
from asymptote.rpc import channel, channel_credentials

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    async def pull(self, endpoint: str, version: int) -> DecodedWeights: ...


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 4 << 20
"""gRPC's default largest message: every message-sized buffer comes from the heap and is reused."""
_TRIM_THRESHOLD_BYTES = 32 << 20
"""Freed memory kept at the top of a heap before glibc hands it back to the kernel."""


def reuse_freed_message_buffers() -> None:
    """Make glibc reuse the ~1 MiB buffers a pull allocates and frees for every message.

    gRPC's receive buffers, each message's bytes and its parsed copy are
    about a chunk each. With glibc's defaults such buffers are mmapped, or
    the heap grows and is trimmed back, for every message, and the kernel
    faults in and zeroes fresh pages each time: receiving an 82 MB version
    took over three times the CPU it takes with the buffers reused. Costs
    at most the trim threshold of idle memory per malloc arena.
    Process-wide and idempotent; does nothing on a C library other than
    glibc.
    """
    if platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)


class GrpcWeightSource:
    """Pull a version from the learner over gRPC (≤1 MiB chunks), verifying it as it arrives.

    Constructing one tunes the process's allocator for pulls (see
    ``reuse_freed_message_buffers``); between pulls it keeps one version's
    worth of memory to write the next version into (see ``BufferPool``).
    """

    def __init__(self, timeout_s: float = 120.0, tls: TlsSettings | None = None) -> None:
        self.timeout_s = timeout_s
        self.tls = tls
        if tls is not None and tls.client_enabled:
            channel_credentials(tls)  # an unreadable certificate fails the start, not every pull
        reuse_freed_message_buffers()
        self._buffers = BufferPool()  # a pull writes into the last pulled version's memory once it is dropped

    async def pull(self, endpoint: str, version: int) -> DecodedWeights:
        with WeightsDecoder(self._buffers) as decoder:
            async with channel(endpoint, self.tls) as ch:
                stub = services_pb2_grpc.LearnerStub(ch)
                request = services_pb2.PullWeightsRequest(version=version)
                # Each part is checked as it lands: a bad stream is refused (and
                # the call cancelled) at its first bad part, not after the last.
                async for part in stub.PullWeights(request, timeout=self.timeout_s):
                    if part is None:  # grpc.aio's answer to response bytes that do not parse
                        raise WeightsError(f"version {version}: the learner sent bytes that are not a WeightsPart")
                    decoder.feed(part)
            weights = decoder.finish()
        if weights.version != version:
            raise WeightsError(f"asked for version {version}, learner sent {weights.version}")
        return weights


def check_signature(weights: DecodedWeights, signature: Signature) -> None:
    """Refuse an update whose names, dtypes or shapes differ from the model's."""
    got = set(weights.tensors)
    want = set(signature)
    if got != want:
        missing = sorted(want - got)[:5]
        extra = sorted(got - want)[:5]
        raise WeightsError(f"version {weights.version}: tensor names differ (missing {missing}, unexpected {extra})")
    for name, tensor in weights.tensors.items():
        dtype, shape = signature[name]
        if tensor.dtype != dtype or tensor.shape != shape:
            raise WeightsError(
                f"version {weights.version}: tensor {name!r} is {tensor.dtype}{list(tensor.shape)}, "
                f"the model needs {dtype}{list(shape)}"
            )


def stage(weights: DecodedWeights, root: Path, model_dir: Path) -> Path:
    """Write a verified version as a loadable checkpoint folder; returns it."""
    from safetensors.torch import save_file

    folder = root / f"v{weights.version}"
    tmp = root / f".v{weights.version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {name: _as_torch(t) for name, t in weights.tensors.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "version": str(weights.version)})
    shutil.copy2(model_dir / "config.json", tmp / "config.json")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def _as_torch(t: WireTensor) -> torch.Tensor:
    """A tensor viewing ``t``'s bytes when they are writable (a pulled version's are), else a copy.

    torch has no read-only tensors: it warns on read-only memory such as ``bytes``.
    """
    import torch

    array = t.to_numpy()
    if not array.flags.writeable:
        array = array.copy()
    if t.dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def prune(root: Path, keep: Path) -> None:
    """Remove staged versions other than ``keep``."""
    for path in root.glob("v*"):
        if path != keep and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
