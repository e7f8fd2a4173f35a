"""Pulling, verifying and staging policy weights on a generator.

Owns the weight-source seam: ``GrpcWeightSource`` pulls a version from the
learner's ``Learner.PullWeights`` stream, or from a peer's
``WeightRelay.PullWeights`` (the fan-out tree, ``services.generator.fanout``,
implements the same ``pull``; an NCCL transfer would too). A pull names the
version the staging area holds, and the source answers with the elements
that changed since (``asymptote.delta``), rebuilt in place over that
version's bytes, or with the whole version; a delta that fails its checks
is pulled again whole. Every update is checked before it reaches the
engine: digest, tensor names, shapes and dtypes against the model the
engine was built from (in a LoRA run, against the adapter the run's
settings put over that base: a version without its adapter is refused by
name), and NaN/Inf. A refused update raises WeightsError and the engine
keeps the version it has. Staged versions are written as
safetensors (never pickle) under a tmpfs folder: a pull decodes straight
into the file (``StagingArea``), so a swap's extra memory is one version's
bytes, on tmpfs, shared with the engine's worker that reads it; a delta is
applied onto the same file, which held the version before, so it adds
only its own (small) frames.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from google.protobuf.message import DecodeError

from asymptote.codec import (
    BufferPool,
    BufferSource,
    DecodedWeights,
    Signature,
    WeightsDecoder,
    safetensors_header,
    signature_num_bytes,
    split_part,
)
from asymptote.config import TlsSettings
from asymptote.contracts.v1 import services_pb2, tensors_pb2
from asymptote.delta import DeltaDecoder
from asymptote.errors import StagingError, WeightsError
from asymptote.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_name
from asymptote.rpc import channel, channel_credentials, reuse_freed_message_buffers
from services.generator.metrics import GeneratorMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldVersion:
    """A verified version whose bytes a buffer holds, laid out as ``signature``: what a delta is applied to."""

    version: int
    digest: str
    signature: Signature


class WeightSource(Protocol):
    async def pull(
        self, endpoint: str, version: int, into: BufferSource | None = None, base: HeldVersion | None = None
    ) -> DecodedWeights:
        """Version ``version``, verified, written into ``into`` (a buffer of the source's own if None).

        ``base``: the version ``into.take`` hands back already written; the
        source may then send only what changed since. ``endpoint``: the
        learner's, as announced with the version.
        """
        ...


LEARNER_PULL = "/asymptote.contracts.v1.Learner/PullWeights"
RELAY_PULL = "/asymptote.contracts.v1.WeightRelay/PullWeights"


def _as_received(frame: bytes) -> bytes:
    return frame


class GrpcWeightSource:
    """Pull a version over gRPC (≤1 MiB parts), verifying it as it arrives; a delta when a base is held.

    ``method``: the learner's ``LEARNER_PULL`` or a peer's ``RELAY_PULL``.
    A delta that fails its checks (wrong base, malformed, rebuilt bytes
    that do not hash to the version's digest) is pulled again whole from
    the same endpoint; ``metrics`` counts each pull by kind (delta, full,
    fallback). Constructing one tunes the process's allocator for pulls
    (see ``reuse_freed_message_buffers``); between pulls it keeps one
    version's worth of memory to write the next version into (see
    ``BufferPool``).
    """

    def __init__(
        self,
        timeout_s: float = 120.0,
        tls: TlsSettings | None = None,
        metrics: GeneratorMetrics | None = None,
        method: str = LEARNER_PULL,
    ) -> None:
        self.timeout_s = timeout_s
        self.tls = tls
        self.metrics = metrics
        self.method = method
        self.sender = "learner" if method == LEARNER_PULL else "peer"
        if tls is not None and tls.client_enabled:
            channel_credentials(tls)  # an unreadable certificate fails the start, not every pull
        reuse_freed_message_buffers()
        self._buffers = BufferPool()  # a pull writes into the last pulled version's memory once it is dropped

    async def pull(
        self, endpoint: str, version: int, into: BufferSource | None = None, base: HeldVersion | None = None
    ) -> DecodedWeights:
        refused = 0
        if base is not None and into is not None:
            try:
                weights, received = await self._pull(endpoint, version, into, base)
            except WeightsError as exc:
                refused = 1
                log.warning("refused the delta for version %d from %s (%s); pulling it whole", version, endpoint, exc)
            else:
                self._count("delta" if weights.delta is not None else "full", received)
                return weights
        weights, received = await self._pull(endpoint, version, into, None)
        self._count("fallback" if refused else "full", received)
        return weights

    def _count(self, kind: str, num_bytes: int) -> None:
        if self.metrics is not None:
            self.metrics.weight_pulls.labels(kind).inc()
            self.metrics.weight_pull_bytes.labels(kind).inc(num_bytes)

    async def _pull(
        self, endpoint: str, version: int, into: BufferSource | None, base: HeldVersion | None
    ) -> tuple[DecodedWeights, int]:
        """One pull; (the verified version, bytes received)."""
        request = services_pb2.PullWeightsRequest(version=version)
        if base is not None:
            request.base_version, request.base_digest = base.version, base.digest
        received = 0
        async with channel(endpoint, self.tls) as ch:
            call = ch.unary_stream(
                self.method,
                request_serializer=services_pb2.PullWeightsRequest.SerializeToString,
                response_deserializer=_as_received,
            )
            # Each part is checked as it lands: a bad stream is refused (and
            # the call cancelled) at its first bad part, not after the last.
            frames = aiter(call(request, timeout=self.timeout_s))
            first = await anext(frames, b"")
            received += len(first)
            header, _ = self._parse(first, version)
            if header.WhichOneof("part") == "header" and header.header.base_version:
                if base is None or header.header.base_version != base.version or into is None:
                    raise WeightsError(f"version {version}: sent a delta from a version not held")
                decoder = DeltaDecoder(header.header, base.signature, into, base.digest)
                received_frames = [first]
                async for frame in frames:
                    received += len(frame)
                    decoder.feed(self._parse(frame, version)[0])
                    received_frames.append(frame)
                # Writing and hashing the whole version takes a while: off the event loop (peers are served there).
                weights = await asyncio.to_thread(decoder.finish, tuple(received_frames))
            else:
                with WeightsDecoder(into or self._buffers) as full:
                    full.feed(header)
                    async for frame in frames:
                        received += len(frame)
                        full.feed(*self._parse(frame, version))
                    weights = full.finish()
        if weights.version != version:
            raise WeightsError(f"asked for version {version}, {self.sender} sent {weights.version}")
        return weights, received

    def _parse(self, frame: bytes, version: int) -> tuple[tensors_pb2.WeightsPart, memoryview | None]:
        return parse_part(frame, version, self.sender)


def parse_part(
    frame: bytes, version: int, sender: str = "learner"
) -> tuple[tensors_pb2.WeightsPart, memoryview | None]:
    """One received frame as its ``WeightsPart`` and a chunk's data, a view of the frame (``split_part``);
    WeightsError naming ``sender`` when it is not a part."""
    try:
        return split_part(frame)
    except DecodeError as exc:
        raise WeightsError(f"version {version}: the {sender} sent bytes that are not a WeightsPart") from exc


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


def check_adapter(weights: DecodedWeights, signature: Signature) -> None:
    """Refuse a LoRA run's version that is not the adapter ``signature`` describes: whole-model weights
    (the base pushed, the adapter not), an adapter with tensors missing, or one of another shape."""
    got = set(weights.tensors)
    if not any(is_adapter_name(n) for n in got):
        example = min(got) if got else "none"
        raise WeightsError(
            f"version {weights.version}: no LoRA adapter in it ({len(got)} tensors, e.g. {example!r}): "
            "whole-model weights where this LoRA run's generator loads an adapter over its base; refused, "
            "the base is never served alone"
        )
    missing = sorted(set(signature) - got)
    if missing:
        raise WeightsError(
            f"version {weights.version}: {len(missing)} of the LoRA adapter's {len(signature)} tensors are "
            f"missing (e.g. {missing[:3]}); refused, a partial adapter is never served"
        )
    check_signature(weights, signature)


STAGED_FILE = "model.safetensors"
SPARE_FILE = ".spare.safetensors"


class StagingArea:
    """The folder on tmpfs a generator's engine loads versions from, holding at most one.

    A version is pulled straight into its safetensors file (``open``): the
    file's header is laid out from the model's signature, and its data
    section, memory-mapped, is the buffer the decoder writes each chunk
    into, so no other copy of the version exists in this process. Once the
    engine has loaded a version its file is kept as the spare (``recycle``)
    and the next version is written over it: its pages are already
    allocated, so the kernel does not zero a version's worth of fresh
    memory per pull, and two versions are never on tmpfs at once. Peak use:
    one version's bytes, whatever the number of swaps.

    The spare still holds the version loaded last (``held``), byte for
    byte at the same offsets (the header's length does not depend on the
    version number), so the next pull can be a delta applied over it in
    place. ``on_overwrite`` is called when a pull starts writing over it
    (whoever serves those bytes to peers stops).

    ``adapter_config``: a LoRA run's area, whose versions are peft adapter
    folders (``adapter_model.safetensors`` with this ``adapter_config.json``).
    A loaded adapter's folder is removed, not kept as the spare: vLLM keeps
    the adapter it loaded in its CPU cache, as tensors that may view the
    file's pages (safetensors maps it), so a version is never written over
    another's pages. An adapter is small; each version is pulled whole.
    """

    def __init__(
        self,
        root: Path,
        on_overwrite: Callable[[], None] | None = None,
        adapter_config: dict[str, object] | None = None,
    ) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.on_overwrite = on_overwrite
        self.adapter_config = adapter_config
        self.file_name = STAGED_FILE if adapter_config is None else ADAPTER_WEIGHTS
        self.held: HeldVersion | None = None
        """The verified version the area's file holds; None once a pull has started writing over it."""

    def clear(self) -> None:
        """Remove what an earlier process left: versions, partial pulls, the spare."""
        self.held = None
        for path in self.root.iterdir():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def open(self, version: int, signature: Signature) -> StagedVersion:
        """Where ``version`` is written as it is pulled; ``commit`` or ``discard`` it."""
        return StagedVersion(self, version, signature)

    def recycle(self, folder: Path) -> None:
        """Keep ``folder``'s file (its version loaded, or dropped) as the buffer of the next pull (an
        adapter's folder: removed)."""
        if self.adapter_config is not None:
            self.held = None
            shutil.rmtree(folder, ignore_errors=True)
            return
        try:
            (folder / STAGED_FILE).rename(self.root / SPARE_FILE)
        except OSError:
            self.held = None
        shutil.rmtree(folder, ignore_errors=True)

    def usage(self) -> int:
        """Bytes the area's files hold."""
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def _overwriting(self) -> None:
        self.held = None
        if self.on_overwrite is not None:
            self.on_overwrite()


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Linux's: the mapping's page tables filled in by the one call."""
_VERSION_WIDTH = 20
"""Digits of the largest version (a uint64): headers are laid out for it."""


class StagedVersion:
    """One version being written into its safetensors file; the decoder's ``BufferSource``."""

    def __init__(self, area: StagingArea, version: int, signature: Signature) -> None:
        self.area = area
        self.version = version
        self.signature = signature
        self.tmp = area.root / f".v{version}.tmp"
        self._buffer: np.ndarray | None = None

    @property
    def base(self) -> HeldVersion | None:
        """The verified version ``take`` hands back already written (the spare's), if any."""
        held = self.area.held
        if self._buffer is not None or held is None or held.signature != self.signature:
            return None
        return held if (self.area.root / SPARE_FILE).exists() else None

    def take(self, num_bytes: int) -> np.ndarray:
        if num_bytes != signature_num_bytes(self.signature):
            # Not this model's weights: decoded in memory (and bounded by the
            # decoder), then refused by the signature check, which names the
            # tensor that differs. Never staged.
            return BufferPool().take(num_bytes)
        if self._buffer is not None:  # a delta refused, now pulled whole: the same file
            return self._buffer
        metadata = {"format": "pt", "version": str(self.version)}
        widest = safetensors_header(self.signature, {**metadata, "version": "9" * _VERSION_WIDTH})
        header = safetensors_header(self.signature, metadata, min_bytes=len(widest))
        size = len(header) + num_bytes
        self.area._overwriting()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        path = self.tmp / self.area.file_name
        spare = self.area.root / SPARE_FILE
        try:
            if spare.exists():
                spare.rename(path)
            with open(path, "a+b") as f:
                f.truncate(size)
                # Reserve every page now: a full tmpfs fails here, by name,
                # not as a SIGBUS on some later write through the mapping.
                os.posix_fallocate(f.fileno(), 0, size)
                # Map every page at once: faulting them in one by one as the
                # decoder writes took as long as the writes themselves.
                mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        except OSError as exc:
            self.discard()
            raise StagingError(
                f"cannot stage version {self.version} ({size / 2**20:.1f} MiB) in {self.area.root}: {exc}; "
                f"{_free_space(self.area.root)}"
            ) from exc
        mapped[: len(header)] = header
        self._buffer = np.frombuffer(mapped, dtype=np.uint8, offset=len(header))
        return self._buffer

    def commit(self, model_dir: Path, digest: str = "") -> Path:
        """The loadable folder of the version, once the decoder verified it against the signature.

        ``digest``: the version's verified digest, so the next pull can be a
        delta from it (none: the next pull is whole).
        """
        if self.area.adapter_config is None:
            shutil.copy2(model_dir / "config.json", self.tmp / "config.json")
        else:
            (self.tmp / ADAPTER_CONFIG).write_text(json.dumps(self.area.adapter_config, indent=2))
        folder = self.area.root / f"v{self.version}"
        shutil.rmtree(folder, ignore_errors=True)
        self.tmp.rename(folder)
        self.area.held = HeldVersion(self.version, digest, self.signature) if digest else None
        return folder

    def discard(self) -> None:
        """Drop a version that will not be loaded; its file stays as the spare."""
        self.area.recycle(self.tmp)


def _free_space(root: Path) -> str:
    try:
        st = os.statvfs(root)
    except OSError:
        return "its size is unknown"
    return f"it holds {st.f_blocks * st.f_frsize / 2**30:.2f} GiB, {st.f_bavail * st.f_frsize / 2**30:.2f} GiB free"


def stage(
    weights: DecodedWeights, root: Path, model_dir: Path, adapter_config: dict[str, object] | None = None
) -> Path:
    """Write a verified version held in memory as a loadable checkpoint folder (with ``adapter_config``, a
    peft adapter folder); returns it. The same file layout a pull into a ``StagingArea`` writes.
    """
    signature = {name: (t.dtype, t.shape) for name, t in weights.tensors.items()}
    staged = StagingArea(root, adapter_config=adapter_config).open(weights.version, signature)
    buffer = staged.take(weights.num_bytes)
    offset = 0
    for name in sorted(weights.tensors):
        data = np.frombuffer(weights.tensors[name].data, dtype=np.uint8)
        buffer[offset : offset + len(data)] = data
        offset += len(data)
    del buffer
    return staged.commit(model_dir)
