"""Pulling, verifying and staging policy weights on a generator.

Owns the weight-source seam: ``GrpcWeightSource`` pulls a version from the
learner's ``Learner.PullWeights`` stream (a peer-to-peer tree or NCCL
transfer would implement the same ``pull``). Every update is checked before
it reaches the engine: sha256, tensor names, shapes and dtypes against the
model the engine was built from, and NaN/Inf. A refused update raises
WeightsError and the engine keeps the version it has. Staged versions are
written as safetensors (never pickle) under a tmpfs folder.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from asymptote.codec import DecodedWeights, Signature, WireTensor, decode
from asymptote.config import TlsSettings
from asymptote.contracts.v1 import services_pb2, services_pb2_grpc
from asymptote.errors import WeightsError
from asymptote.rpc import channel, channel_credentials

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

class WeightSource(Protocol):
    async def pull(self, endpoint: str, version: int) -> DecodedWeights: ...


class GrpcWeightSource:
    """Pull a version from the learner over gRPC (≤1 MiB chunks)."""

    def __init__(self, timeout_s: float = 120.0, tls: TlsSettings | None = None) -> None:
        self.timeout_s = timeout_s
        self.tls = tls
        if tls is not None and tls.client_enabled:
            channel_credentials(tls)  # an unreadable certificate fails the start, not every pull

    async def pull(self, endpoint: str, version: int) -> DecodedWeights:
        async with channel(endpoint, self.tls) as ch:
            stub = services_pb2_grpc.LearnerStub(ch)
            parts = [
                part
                async for part in stub.PullWeights(
                    services_pb2.PullWeightsRequest(version=version), timeout=self.timeout_s
                )
            ]
        weights = decode(parts)
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
    tensors = {name: _to_torch(t) for name, t in weights.tensors.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "version": str(weights.version)})
    shutil.copy2(model_dir / "config.json", tmp / "config.json")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def _to_torch(t: WireTensor) -> "torch.Tensor":
    import torch

    if t.dtype == "bfloat16":
        return torch.frombuffer(bytearray(t.data), dtype=torch.bfloat16).reshape(t.shape)
    return torch.from_numpy(t.to_numpy().copy())


def prune(root: Path, keep: Path) -> None:
    """Remove staged versions other than ``keep``."""
    for path in root.glob("v*"):
        if path != keep and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
