"""In-flight weight updates: watch the policy version, pull, verify, swap.

Owns the loop that keeps a generator on the learner's newest version. It
always loads the newest announced version (skipping ones superseded while a
pull was under way), refuses bad updates without disturbing the engine, and
records per-swap telemetry (bytes, pull time, pause, sequences carried). In
a LoRA run every version is an adapter over the engine's base: checked
against the adapter the run's settings put over that base (whole-model
weights, or an adapter with tensors missing, are refused by name), and the
first version announced is loaded whatever its number, as the engine
samples nothing before it holds an adapter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Literal, Protocol

from nats.js.kv import KeyValue

from asymptote.codec import read_signature
from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import StagingError, WeightsError
from asymptote.jetstream.names import Names
from asymptote.lora import LoraSettings, adapter_config, adapter_signature
from asymptote.policy import watch_policy
from services.generator.engine import SwapReport
from services.generator.fanout import WeightRelay
from services.generator.metrics import GeneratorMetrics
from services.generator.weights import StagingArea, WeightSource, check_adapter, check_signature

log = logging.getLogger(__name__)


class SwapTarget(Protocol):
    """What the swapper loads versions into: the engine (``Engine``), or a stand-in that only counts."""

    version: int

    async def swap(self, weights_path: Path, version: int, mode: Literal["inflight", "drain"]) -> SwapReport: ...


RETRY_S = 1.0
"""Wait before pulling again a version that could not be pulled or staged."""
HOLD_RECHECK_S = 0.5
"""How often a held swap looks again at the learner's newest version."""


class EvalHold:
    """Keeps a generator on the version an eval round is being sampled at.

    An eval round names the version it measures. With in-flight updates a
    round would otherwise be sampled by whichever versions the learner makes
    while the generators work through it (a round of a few hundred prompts
    spans several steps), and its point on the curve would mix them. While
    eval tasks at or below the engine's version are leased, the swapper
    waits, unless the learner is more than ``max_versions`` ahead: train
    groups sampled meanwhile are that much staler at most, and the broker's
    staleness bound still applies to them. 0 turns the hold off.
    """

    def __init__(self, max_versions: int) -> None:
        self.max_versions = max_versions
        self._versions: dict[int, int] = {}
        """Leased eval tasks: a key per task, the version it requires."""
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self, key: int, version: int) -> None:
        self._versions[key] = version
        self._idle.clear()

    def end(self, key: int) -> None:
        self._versions.pop(key, None)
        if not self._versions:
            self._idle.set()

    def holds(self, current: int, newest: int) -> bool:
        """Whether a swap from ``current`` to ``newest`` waits for the eval tasks sampled at ``current``."""
        if self.max_versions <= 0 or newest - current > self.max_versions:
            return False
        return any(v <= current for v in self._versions.values())

    async def wait(self, timeout_s: float) -> None:
        """Return when no eval task is leased, or after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass


class Swapper:
    def __init__(
        self,
        engine: SwapTarget,
        source: WeightSource,
        model_dir: Path,
        weights_dir: Path,
        mode: str,
        metrics: GeneratorMetrics,
        relay: WeightRelay | None = None,
        hold: EvalHold | None = None,
        lora: LoraSettings | None = None,
    ) -> None:
        self.engine = engine
        self.hold = hold
        self.source = source
        self.model_dir = model_dir
        self.relay = relay
        """Serves the staged version to peers, from when it is verified until a pull writes over it."""
        self.lora = lora
        base = read_signature(model_dir)
        self.signature = base if lora is None else adapter_signature(base, lora)
        """What every version must hold: the model directory's tensors, or the adapter over them."""
        self.awaiting_adapter = lora is not None
        """A LoRA run before its first adapter: the engine samples nothing until one is loaded."""
        self.staging = StagingArea(
            weights_dir,
            on_overwrite=relay.retire if relay is not None else None,
            adapter_config=None if lora is None else adapter_config(lora, self.signature, str(model_dir)),
        )
        self.staging.clear()
        self.mode = mode
        self.metrics = metrics
        self.latest: rollout_pb2.PolicyVersion | None = None
        self.refused: dict[int, str] = {}
        self._announced = asyncio.Event()

    async def watch_loop(self, kv: KeyValue, names: Names, stop: asyncio.Event) -> None:
        async for policy in watch_policy(kv, names, stop):
            self.latest = policy
            self._announced.set()

    async def swap_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(self._announced.wait(), 1.0)
            except TimeoutError:
                continue
            self._announced.clear()
            policy = self.latest
            if policy is None or policy.version in self.refused:
                continue
            if policy.version <= self.engine.version and not self.awaiting_adapter:
                continue
            if (
                self.hold is not None
                and not self.awaiting_adapter
                and self.hold.holds(self.engine.version, int(policy.version))
            ):
                held_from = time.monotonic()
                await self.hold.wait(HOLD_RECHECK_S)
                self.metrics.swap_held_s.inc(time.monotonic() - held_from)
                self._announced.set()  # look again: the round may be done, or the learner too far ahead
                continue
            await self.update(policy)

    async def update(self, policy: rollout_pb2.PolicyVersion) -> bool:
        """Pull, verify and load ``policy``; False (engine untouched) if refused."""
        version = int(policy.version)
        started = time.monotonic()
        staged = self.staging.open(version, self.signature)
        try:
            weights = await self.source.pull(policy.weights_endpoint, version, into=staged, base=staged.base)
            if weights.digest != policy.digest:
                raise WeightsError(
                    f"version {version}: digest {weights.digest[:12]}… differs from the announced {policy.digest[:12]}…"
                )
            if self.lora is None:
                check_signature(weights, self.signature)
            else:
                check_adapter(weights, self.signature)
            folder = await asyncio.to_thread(staged.commit, self.model_dir, weights.digest)
            if self.relay is not None:
                self.relay.hold(weights)
        except WeightsError as exc:
            staged.discard()
            self._refuse(version, exc)
            return False
        except StagingError as exc:  # not the version's fault: pull it again later
            staged.discard()
            self.metrics.swaps_refused.labels("staging").inc()
            log.error("%s; still serving version %d, retrying in %.0f s", exc, self.engine.version, RETRY_S)
            await self._retry_later()
            return False
        except Exception as exc:  # learner unreachable: retry on the next announcement
            staged.discard()
            self.metrics.swaps_refused.labels("unreachable").inc()
            log.warning("could not pull version %d from %s: %s", version, policy.weights_endpoint, exc)
            await self._retry_later()
            return False
        pulled = time.monotonic() - started
        try:
            report = await self.engine.swap(folder, version, "inflight" if self.mode == "inflight" else "drain")
        except WeightsError as exc:  # an adapter vLLM would not load: the engine serves the one it had
            self._refuse(version, exc)
            return False
        finally:
            await asyncio.to_thread(self.staging.recycle, folder)
        m = self.metrics
        m.swaps.inc()
        if self.lora is not None:
            m.adapter_versions.inc()
            self.awaiting_adapter = False
        m.swap_pull_s.observe(pulled)
        m.swap_pause_s.observe(report.paused_s)
        m.swap_load_s.observe(report.load_s)
        m.swap_last_pause_s.set(report.paused_s)
        m.swap_bytes.inc(weights.num_bytes)
        m.swap_carried.inc(report.num_running)
        m.policy_version.set(version)
        log.info(
            "loaded version %d: %.1f MB (%s), pull %.1f ms, staged %.1f ms, waited %.1f ms for the step, "
            "paused %.1f ms (loading %.1f ms from %s memory%s), %d sequences carried across",
            version,
            weights.num_bytes / 1e6,
            f"delta of {weights.delta.num_bytes / 1e6:.2f} MB" if weights.delta is not None else "whole",
            pulled * 1e3,
            report.staged_s * 1e3,
            report.pause_wait_s * 1e3,
            report.paused_s * 1e3,
            report.load_s * 1e3,
            report.placement,
            f", packed while generating in {report.prepare_s * 1e3:.1f} ms" if report.prepacked else "",
            report.num_running,
        )
        return True

    def _refuse(self, version: int, exc: WeightsError) -> None:
        self.refused[version] = str(exc)
        self.metrics.swaps_refused.labels("invalid").inc()
        serving = "no adapter yet" if self.awaiting_adapter else f"version {self.engine.version}"
        log.error("refused weights: %s; still serving %s", exc, serving)

    async def _retry_later(self) -> None:
        await asyncio.sleep(RETRY_S)
        self._announced.set()
