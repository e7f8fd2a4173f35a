"""Policy versions as served to generators.

Owns turning the model's parameters into a wire version (the tensors the
model directory's safetensors hold, under the same Hugging Face names and
in the same dtypes, so a generator reloads them as a checkpoint of the model
it serves: a bf16 model gets bf16 updates from the float32 master weights),
its sha256, and keeping the
newest few versions in memory for ``Learner.PullWeights``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from asymptote.codec import Signature, WireTensor, digest
from services.learner.model import TORCH_DTYPES


@dataclass(frozen=True)
class Version:
    version: int
    tensors: dict[str, WireTensor]
    sha256: str

    @property
    def num_bytes(self) -> int:
        return sum(len(t.data) for t in self.tensors.values())


def to_wire(tensor: torch.Tensor, dtype: str | None = None) -> WireTensor:
    """``tensor``'s bytes on the wire, converted to ``dtype`` (the served dtype) when given."""
    if dtype is not None and dtype not in TORCH_DTYPES:
        raise ValueError(f"cannot serve weights as {dtype}; served dtypes are {sorted(TORCH_DTYPES)}")
    t = tensor.detach().to("cpu", TORCH_DTYPES[dtype] if dtype else None).contiguous()
    if t.dtype == torch.bfloat16:
        return WireTensor("bfloat16", tuple(t.shape), t.view(torch.int16).numpy().tobytes())
    return WireTensor.from_numpy(t.numpy())


class WeightStore:
    """The newest ``keep`` versions, thread-safe (written by the step thread)."""

    def __init__(self, signature: Signature, keep: int = 2) -> None:
        self.signature = dict(signature)
        """Name -> (dtype, shape) of the model directory's tensors: what generators load, in the dtype they hold."""
        self.names = sorted(signature)
        self.keep = keep
        self._versions: OrderedDict[int, Version] = OrderedDict()
        self._lock = threading.Lock()

    def snapshot(self, version: int, model: torch.nn.Module) -> Version:
        """``model``'s weights (whole, in one process) as ``version``."""
        state = model.state_dict()
        missing = [n for n in self.names if n not in state]
        if missing:
            raise KeyError(f"model has no parameters named {missing[:5]} (the model directory's tensors)")
        return self.snapshot_tensors(version, ((name, state[name]) for name in self.names))

    def snapshot_tensors(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> Version:
        """``version`` from (name, whole tensor) pairs, converted as they come (one held at a time).

        The pairs must be exactly the model directory's tensors (KeyError naming the difference).
        """
        wire: dict[str, WireTensor] = {}
        for name, tensor in tensors:
            if name not in self.signature:
                raise KeyError(f"{name} is not one of the model directory's tensors")
            wire[name] = to_wire(tensor, self.signature[name][0])
        missing = [n for n in self.names if n not in wire]
        if missing:
            raise KeyError(f"no tensors given for {missing[:5]} (the model directory's tensors)")
        return self.put(Version(version, wire, digest(wire)))

    def put(self, v: Version) -> Version:
        """Hold ``v`` as served; the oldest beyond ``keep`` are dropped."""
        with self._lock:
            self._versions[v.version] = v
            while len(self._versions) > self.keep:
                self._versions.popitem(last=False)
        return v

    def get(self, version: int = 0) -> Version | None:
        """``version`` 0 means the newest."""
        with self._lock:
            if not self._versions:
                return None
            if version == 0:
                return next(reversed(self._versions.values()))
            return self._versions.get(version)
