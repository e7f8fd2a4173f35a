"""The weight fan-out tree: generators re-serve the version they hold to the generators below them.

Owns who pulls from whom and the generator's side of serving. With degree
k, generator i pulls from generator ``i // k - 1`` and the first k pull
from the learner, so the learner sends each version k times (k deltas,
once generators hold a base) whatever the fleet's size, and every
generator sends it at most k times. ``PeerWeightSource`` walks up the tree
when a peer is dead, slow or sends bytes that fail their checks, and ends
at the learner; it never returns bytes that failed the digest check (the
decoders refuse them). ``WeightRelay`` serves ``WeightRelay.PullWeights``
from the version the generator staged: the delta it received, to a peer
that holds that delta's base, else the whole version read from the staged
file. A request for a version not there yet is held until it arrives (or
the caller's deadline nears), so a subtree pulls as soon as its parent
holds the version. Does not know how peers are addressed beyond an
endpoint template (``FanoutSettings``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import AsyncIterator

import grpc
import numpy as np

from asymptote.codec import BufferSource, DecodedWeights, encode_frames
from asymptote.config import TlsSettings
from asymptote.contracts.v1 import services_pb2
from asymptote.errors import StagingError, WeightsError
from asymptote.rpc import add_service
from services.generator.config import FanoutSettings
from services.generator.metrics import GeneratorMetrics
from services.generator.weights import RELAY_PULL, GrpcWeightSource, HeldVersion, WeightSource

log = logging.getLogger(__name__)

_RELAY = services_pb2.DESCRIPTOR.services_by_name["WeightRelay"]
RELAY_SERVICE = _RELAY.full_name
MAX_HOLD_S = 60.0
"""Longest a relay holds a request for a version it does not have yet, when the caller set no deadline."""


def parent_of(index: int, degree: int) -> int | None:
    """The generator that generator ``index`` pulls from; None: the learner."""
    parent = index // degree - 1
    return parent if parent >= 0 else None


def ancestors(index: int, degree: int) -> list[int]:
    """Generator ``index``'s parent, its parent's parent, ... up to a child of the learner."""
    chain: list[int] = []
    node = parent_of(index, degree)
    while node is not None:
        chain.append(node)
        node = parent_of(node, degree)
    return chain


def own_index(settings: FanoutSettings, hostname: str | None = None) -> int:
    """This generator's place in the tree: configured, or the number its host name ends with."""
    if settings.index is not None:
        return settings.index
    name = hostname if hostname is not None else socket.gethostname()
    match = re.search(r"(\d+)$", name)
    if match is None:
        raise ValueError(
            f"fanout.index is not set and the host name {name!r} does not end with a number "
            "(a StatefulSet pod's ordinal); set fanout.index or fanout.degree: 0"
        )
    return int(match.group(1))


def peer_endpoints(settings: FanoutSettings, index: int) -> list[str]:
    """The endpoints a generator at ``index`` pulls from before the learner, nearest first."""
    if settings.degree == 0:
        return []
    return [settings.peer_endpoint.format(index=i) for i in ancestors(index, settings.degree)]


class _Watched:
    """A buffer source that remembers whether a pull started writing (then the base it held is gone)."""

    def __init__(self, inner: BufferSource) -> None:
        self.inner = inner
        self.taken = False

    def take(self, num_bytes: int) -> np.ndarray:
        self.taken = True
        return self.inner.take(num_bytes)


class PeerWeightSource:
    """Pull from the nearest live ancestor in the tree, moving up on failure, and from the learner last."""

    def __init__(
        self,
        peers: list[str],
        peer_timeout_s: float,
        timeout_s: float = 120.0,
        tls: TlsSettings | None = None,
        metrics: GeneratorMetrics | None = None,
    ) -> None:
        self.peers = peers
        self.metrics = metrics
        self._peer = GrpcWeightSource(peer_timeout_s, tls, metrics, RELAY_PULL)
        self._learner = GrpcWeightSource(timeout_s, tls, metrics)

    async def pull(
        self, endpoint: str, version: int, into: BufferSource | None = None, base: HeldVersion | None = None
    ) -> DecodedWeights:
        for peer in self.peers:
            watched = _Watched(into) if into is not None else None
            try:
                return await self._peer.pull(peer, version, watched, base)
            except StagingError:
                raise  # not the peer's fault
            except (WeightsError, grpc.aio.AioRpcError, OSError, TimeoutError) as exc:
                if self.metrics is not None:
                    self.metrics.weight_peer_failures.inc()
                what = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("could not pull version %d from peer %s (%s); moving up the tree", version, peer, what)
            if watched is not None and watched.taken:
                base = None  # written over: the next source sends the whole version
        return await self._learner.pull(endpoint, version, into, base)


class WeightRelay:
    """Serves ``WeightRelay.PullWeights`` from the version this generator holds.

    The swapper calls ``hold`` with a verified version whose tensors view
    its staged file, and the staging area calls ``retire`` before a pull
    writes over that file; a stream under way when that happens is ended
    (UNAVAILABLE) before it sends a byte of the next version, and its
    receiver moves up the tree.
    """

    def __init__(self, metrics: GeneratorMetrics | None = None) -> None:
        self.metrics = metrics
        self._held: DecodedWeights | None = None
        self._generation = 0
        self._arrived = asyncio.Event()

    def hold(self, weights: DecodedWeights) -> None:
        self._held = weights
        self._generation += 1
        self._arrived.set()
        self._arrived = asyncio.Event()

    def retire(self) -> None:
        self._held = None
        self._generation += 1

    async def _wait_for(self, version: int, remaining_s: float | None) -> DecodedWeights | None:
        """The held version once it is ``version`` or newer; what is held when the wait ends."""
        wait_s = MAX_HOLD_S if remaining_s is None else remaining_s - min(1.0, remaining_s / 10)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while (held := self._held) is None or held.version < version:
            arrived = self._arrived
            try:
                await asyncio.wait_for(arrived.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return self._held
        return held

    async def PullWeights(
        self, request: services_pb2.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        held = await self._wait_for(int(request.version), context.time_remaining())
        if held is None or held.version != request.version:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"version {request.version} is not held here; holding {held.version if held else 'none'}",
            )
            return
        generation = self._generation
        delta = held.delta
        if delta is not None and (request.base_version, request.base_digest) == (
            delta.base_version,
            delta.base_digest,
        ):
            frames, kind = iter(delta.frames), "delta"
        else:
            frames, kind = encode_frames(held.version, held.tensors, held.digest), "full"
        for frame in frames:
            if self._generation != generation:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"version {held.version} was written over while it was being sent"
                )
                return
            if self.metrics is not None:
                self.metrics.weight_relay_bytes.labels(kind).inc(len(frame))
            yield frame


def add_relay_to_server(relay: WeightRelay, server: grpc.aio.Server) -> None:
    """Register the WeightRelay service (frames go out already serialized, as the learner's do)."""
    add_service(server, _RELAY, relay, serialized=["PullWeights"])


def weight_source(
    settings: FanoutSettings,
    tls: TlsSettings | None,
    metrics: GeneratorMetrics,
    hostname: str | None = None,
) -> WeightSource:
    """The generator's weight source: straight from the learner, or through the tree."""
    if settings.degree == 0:
        return GrpcWeightSource(tls=tls, metrics=metrics)
    index = own_index(settings, hostname)
    peers = peer_endpoints(settings, index)
    log.info(
        "weight fan-out: generator %d of a degree-%d tree pulls from %s", index, settings.degree, peers or "the learner"
    )
    return PeerWeightSource(peers, settings.peer_timeout_s, tls=tls, metrics=metrics)
