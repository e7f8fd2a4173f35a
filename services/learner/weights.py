"""Policy versions as served to generators.

Owns turning the model's parameters into a wire version (the tensors the
model directory's safetensors hold, under the same Hugging Face names and
in the same dtypes, so a generator reloads them as a checkpoint of the model
it serves: a bf16 model gets bf16 updates from the float32 master weights;
a parameter stored in other tensors, as a mixture of experts' fused expert
tensors are stored one per expert, is served as those tensors), its digest, and keeping the
newest few versions in memory for ``Learner.PullWeights``, with the deltas
between them (``asymptote.delta``) encoded once each and served to every
generator that holds the base.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from asymptote.codec import Signature, WireTensor, tensor_num_bytes, version_digest
from asymptote.delta import delta_frames
from services.learner.host_buffers import HostBuffers, Segment
from services.learner.model import TORCH_DTYPES, aliases, stored_name, stored_parts


@dataclass(frozen=True)
class Version:
    version: int
    tensors: dict[str, WireTensor]
    digest: str

    @property
    def num_bytes(self) -> int:
        return sum(len(t.data) for t in self.tensors.values())


def to_wire(tensor: torch.Tensor, dtype: str | None = None, into: Segment | None = None) -> WireTensor:
    """``tensor``'s bytes on the wire, converted to ``dtype`` (the served dtype) when given.

    Cast where the tensor lives (a GPU's bf16 copy is half the bytes to move), then copied once into
    host memory the wire tensor's bytes are a view of: ``into`` (a segment of ``HostBuffers``), or memory of
    its own. Into a segment a GPU tensor's copy is only queued on the current stream: the caller
    synchronizes it before anything reads the bytes (``WeightStore.stage`` does, once a version).
    """
    if dtype is not None and dtype not in TORCH_DTYPES:
        raise ValueError(f"cannot serve weights as {dtype}; served dtypes are {sorted(TORCH_DTYPES)}")
    src = tensor.detach()
    if dtype is not None and src.dtype != TORCH_DTYPES[dtype]:
        src = src.to(TORCH_DTYPES[dtype])
    name = "bfloat16" if src.dtype == torch.bfloat16 else str(src.dtype).removeprefix("torch.")
    if into is not None:
        num_bytes = src.numel() * src.element_size()
        if into.host.numel() != num_bytes:
            raise ValueError(f"a {num_bytes}-byte tensor into a segment of {into.host.numel()} bytes")
        if num_bytes:
            into.host.view(src.dtype).view(src.shape).copy_(src, non_blocking=src.is_cuda)
            if src.is_cuda:  # its memory is not reused before the queued copy has read it
                src.record_stream(torch.cuda.current_stream(src.device))
        return WireTensor(name, tuple(src.shape), into.data)
    host = torch.empty(src.shape, dtype=src.dtype)
    host.copy_(src)
    raw = host.view(torch.int16) if host.dtype == torch.bfloat16 else host
    return WireTensor(name, tuple(host.shape), memoryview(raw.numpy()).cast("B"))  # type: ignore[arg-type]


def stored_layout(model: torch.nn.Module) -> dict[str, str]:
    """Each stored tensor the model directory holds -> the state-dict entry it is a part of.

    Most are their own entry; a parameter transformers converts on loading
    (``model.stored_parts``: an MoE layer's ``mlp.experts.gate_up_proj``
    [experts, 2 x width, hidden]) has one stored tensor per part (each
    expert's ``gate_proj`` and ``up_proj``). Tied aliases are left out.
    """
    tied = aliases(model)
    out: dict[str, str] = {}
    for key, tensor in model.state_dict().items():
        if key not in tied:
            for part in stored_parts(model, stored_name(key), tuple(tensor.shape)):
                out[part] = key
    return out


def split_stored(model: torch.nn.Module, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """State-dict entry ``key``'s whole ``tensor`` as the stored tensors it is saved as, by stored name.

    ``{key: tensor}`` for an entry stored as itself; a converted one is split
    by transformers' own reverse conversion, what ``save_pretrained`` writes.
    """
    name = stored_name(key)
    if set(stored_parts(model, name, tuple(tensor.shape))) == {name}:
        return {name: tensor}
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    assert isinstance(model, PreTrainedModel), "only a transformers model converts its stored tensors"
    parts: dict[str, torch.Tensor] = revert_weight_conversion(model, {name: tensor})
    return parts


def source_keys(names: Sequence[str], layout: dict[str, str], state: dict[str, torch.Tensor]) -> list[str]:
    """The state-dict entries that hold ``names`` (stored names, ``stored_layout``, or state-dict names), each
    once, in order. KeyError naming what the model holds under neither."""
    missing = [n for n in names if layout.get(n, n) not in state]
    if missing:
        raise KeyError(f"model has no parameters named {missing[:5]} (the model directory's tensors)")
    return list(dict.fromkeys(layout.get(n, n) for n in names))


def served_parts(
    model: torch.nn.Module, names: set[str], key: str, tensor: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """Those of ``names`` that state-dict entry ``key``'s whole ``tensor`` holds: itself when asked for by its
    own name, and its stored parts (``split_stored``)."""
    if key in names:
        yield key, tensor
    for name, part in split_stored(model, key, tensor).items():
        if name in names and name != key:
            yield name, part


def stored_tensors(model: torch.nn.Module, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each of ``names`` from a whole model (``source_keys``), each entry split once.
    KeyError, before anything is split, for a name the model does not hold."""
    state = model.state_dict()
    keys = source_keys(names, stored_layout(model), state)
    wanted = set(names)
    for key in keys:
        yield from served_parts(model, wanted, key, state[key].detach())


def served_signature(model: torch.nn.Module, dtype: str) -> Signature:
    """The signature ``model`` serves every tensor of in ``dtype``, in the stored layout (``stored_layout``;
    a tied weight under its first name)."""
    tied = aliases(model)
    out: Signature = {}
    for key, tensor in model.state_dict().items():
        if key not in tied:
            out |= {
                name: (dtype, shape)
                for name, shape in stored_parts(model, stored_name(key), tuple(tensor.shape)).items()
            }
    return out


@dataclass(frozen=True)
class Staged:
    """A version's tensors copied out in the served dtypes, not yet digested (``WeightStore.publish``)."""

    version: int
    tensors: dict[str, WireTensor]


class WeightStore:
    """The newest ``keep`` versions, and deltas between them, thread-safe (written by the step thread).

    Memory: ``keep`` versions in the served dtype, plus the deltas encoded
    from them to the newest (each a few percent of a version after a step).
    """

    def __init__(self, signature: Signature, keep: int = 2, host_buffers: HostBuffers | None = None) -> None:
        self.signature = dict(signature)
        """Name -> (dtype, shape) of the model directory's tensors: what generators load, in the dtype they hold."""
        self.names = sorted(signature)
        self.keep = keep
        self.host_buffers = host_buffers
        """Where versions are copied out to (page-locked on a GPU); None: memory of each tensor's own."""
        self._versions: OrderedDict[int, Version] = OrderedDict()
        self._lock = threading.Lock()
        self._deltas: dict[tuple[int, int], list[bytes] | None] = {}
        """(base, version) -> the delta's frames; None when it is no smaller than the version."""
        self._encoding: dict[tuple[int, int], threading.Lock] = {}

    def snapshot(self, version: int, model: torch.nn.Module) -> Version:
        """``model``'s weights (whole, in one process) as ``version``, in the model directory's layout."""
        return self.snapshot_tensors(version, stored_tensors(model, self.names))

    def snapshot_tensors(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> Version:
        """``version`` from (name, whole tensor) pairs: ``stage`` then ``publish``."""
        return self.publish(self.stage(version, tensors))

    def stage(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> Staged:
        """``version``'s tensors copied out in the served dtypes, converted as they come (one held at a time).

        The part of serving that must see the weights before the next step
        moves them; ``publish`` (the digest) can run beside that step. The
        pairs must be exactly the model directory's tensors (KeyError naming
        the difference).
        """
        segments: dict[str, Segment] = {}
        if self.host_buffers is not None:
            sizes = [tensor_num_bytes(*self.signature[n]) for n in self.names]
            segments = dict(zip(self.names, self.host_buffers.lease(sizes), strict=True))
        wire: dict[str, WireTensor] = {}
        devices: set[torch.device] = set()
        for name, tensor in tensors:
            if name not in self.signature:
                raise KeyError(f"{name} is not one of the model directory's tensors")
            wire[name] = to_wire(tensor, self.signature[name][0], segments.get(name))
            if tensor.is_cuda:
                devices.add(tensor.device)
        for device in devices:  # the copies into page-locked segments were queued: one wait for them all
            torch.cuda.current_stream(device).synchronize()
        missing = [n for n in self.names if n not in wire]
        if missing:
            raise KeyError(f"no tensors given for {missing[:5]} (the model directory's tensors)")
        return Staged(version, wire)

    def publish(self, staged: Staged) -> Version:
        """Digest a staged version and hold it as served (blocking: call it off the event loop)."""
        return self.put(Version(staged.version, staged.tensors, version_digest(staged.tensors)))

    def put(self, v: Version) -> Version:
        """Hold ``v`` as served; the oldest beyond ``keep`` are dropped."""
        with self._lock:
            self._versions[v.version] = v
            while len(self._versions) > self.keep:
                self._versions.popitem(last=False)
            for key in [k for k in self._deltas if not set(k) <= set(self._versions)]:
                del self._deltas[key]
        return v

    def delta(self, version: int, base_version: int, base_digest: str) -> list[bytes] | None:
        """Serialized frames of ``version`` as its changes since ``base_version``; None to send it whole.

        None when either version is not held, the base held has another
        digest than ``base_digest``, or the delta is no smaller than the
        version. Encoded once per pair (callers asking at once wait for the
        first); blocking, so call it off the event loop.
        """
        with self._lock:
            target, base = self._versions.get(version), self._versions.get(base_version)
            if target is None or base is None or base.digest != base_digest or base_version >= version:
                return None
            key = (base_version, version)
            encoding = self._encoding.setdefault(key, threading.Lock())
        with encoding:
            with self._lock:
                if key in self._deltas:
                    return self._deltas[key]
            encoded = delta_frames(version, target.tensors, target.digest, base_version, base.tensors, base.digest)
            frames = encoded if sum(map(len, encoded)) < target.num_bytes else None
            with self._lock:
                if target.version in self._versions and base.version in self._versions:
                    self._deltas[key] = frames
                self._encoding.pop(key, None)
        return frames

    def get(self, version: int = 0) -> Version | None:
        """``version`` 0 means the newest."""
        with self._lock:
            if not self._versions:
                return None
            if version == 0:
                return next(reversed(self._versions.values()))
            return self._versions.get(version)
