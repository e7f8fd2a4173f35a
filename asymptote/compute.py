"""Compute accounting: each instance's work in FLOPs, and the accelerator time it held.

The curve's x-axis is training compute in floating-point operations,
generators plus learner, counted from the tokens each service processed and
never from timings: 2N per token a generator prefilled or sampled, 6N per
token the learner trained (forward 2N, backward 4N), with N the model's
parameters a token is multiplied through (``flop_params``). Two runs of one
recipe thus reach the same compute at the same step whatever else the
machine is doing. Beside it, each instance reports the accelerator time it
held (wall seconds x devices since it started, and the busy part of it):
the run's cost, published and shown, but not the axis. On dedicated
accelerators the two relate by FLOPs / (peak FLOP/s x MFU) = device-seconds.

Each instance publishes its own cumulative totals; the fitter sums the latest
of every instance ever seen, which integrates over a changing number of
generators. A generator also reports the part spent sampling eval rounds
(their tokens' FLOPs exactly; for device time, each interval's split by the
tokens it sampled for each kind of task), which the axis leaves out:
measuring the policy is not training it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import struct
import time
from pathlib import Path
from typing import Literal

from nats.js import JetStreamContext

from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names

log = logging.getLogger(__name__)


ComputeUnit = Literal["flops", "device_seconds"]
"""The unit of a compute axis: FLOPs of the tokens processed (the default), or device-seconds held (the cost;
what eval logs written before the FLOPs axis hold)."""

FORWARD_FLOPS_PER_PARAM = 2
"""FLOPs per parameter per token of a forward pass: one multiply and one add (Kaplan et al. 2020, arXiv
2001.08361, section 2.1); what a generator spends on each token it prefills or samples."""
TRAIN_FLOPS_PER_PARAM = 6
"""FLOPs per parameter per token of a training step: the forward's 2 and the backward's 4 (ibid.)."""

# Parameter names of the input embedding lookup and of learned position embeddings (a gather, no
# multiply), and of the output head, across Hugging Face families (llama/qwen/mistral embed_tokens,
# gpt2 wte/wpe, bloom word_embeddings, gpt-neox embed_in/embed_out, opt embed_positions).
_INPUT_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|embed_in)\.weight$")
_POSITION_EMBEDDING = re.compile(r"(^|\.)(wpe|embed_positions|position_embeddings)\.weight$")
_OUTPUT_HEAD = re.compile(r"(^|\.)(lm_head|embed_out)\.weight$")
# A safetensors header larger than this is not one (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


def _safetensors_sizes(path: Path) -> dict[str, int]:
    """Each tensor's number of elements, from a safetensors file's header (the weights are not read)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a safetensors header of {length} bytes is not one")
        header = json.loads(f.read(length))
    return {name: math.prod(int(n) for n in entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def flop_params(model_dir: Path) -> int:
    """N of the FLOPs count: the parameters each token is multiplied through, from the model directory's
    safetensors headers (torch-free; nothing but the headers is read).

    Every weight but the input embedding lookup and learned position embeddings (a gather costs no
    multiply-adds), with the output head counted once: a tied head (no ``lm_head`` tensor stored) is the
    embedding matrix used as a matmul. Kaplan's N leaves out the head as well, which is harmless at 8B
    (4096 x 151k is 7% of Qwen3-8B) but not on a tiny model, where the head is most of the work. 0 when
    the directory holds no safetensors files (the FLOPs axis then reads 0: the fitter says so).
    """
    sizes: dict[str, int] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        sizes.update(_safetensors_sizes(path))
    embedding = [n for n in sizes if _INPUT_EMBEDDING.search(n)]
    lookups = embedding + [n for n in sizes if _POSITION_EMBEDDING.search(n)]
    total = sum(sizes.values()) - sum(sizes[n] for n in lookups)
    if embedding and not any(_OUTPUT_HEAD.search(n) for n in sizes):
        total += sizes[embedding[0]]  # tied: the head is the embedding matrix, stored once
    return total


_SI_PREFIXES = ("", "k", "M", "G", "T", "P", "E", "Z", "Y")


def flops_text(flops: float, *more: float, unit_of: float | None = None) -> str:
    """FLOPs as people count them, with an SI prefix chosen by the first value (or by ``unit_of``, e.g. the
    total of a line's parts): "3.41 PFLOP", "201 [150, 260] TFLOP" (``more``, an interval's ends, in the
    same unit)."""
    rounded = float(f"{abs(flops if unit_of is None else unit_of):.3g}")  # 999.9e12 is 1 PFLOP, not 1e+03 TFLOP
    power = min(max(math.floor(math.log10(rounded) / 3) if rounded else 0, 0), len(_SI_PREFIXES) - 1)
    scale = 1000.0**power

    def shown(x: float) -> str:
        return f"{x / scale:.3g}"

    ends = f" [{', '.join(shown(x) for x in more)}]" if more else ""
    return f"{shown(flops)}{ends} {_SI_PREFIXES[power]}FLOP"


def compute_text(value: float, unit: ComputeUnit, *more: float) -> str:
    """A compute value (and an interval's ends) in its axis's unit, as ``flops_text`` or ``device_time``."""
    return flops_text(value, *more) if unit == "flops" else device_time(value, *more)


def compute_interval_text(low: float, high: float, unit: ComputeUnit) -> str:
    """An interval of compute in its axis's unit, scaled by its lower end: "[0.57, 0.61] device-hours"."""
    text = compute_text(low, unit, low, high)
    return text[text.index("[") :]


COMPUTE_UNIT_LABELS: dict[ComputeUnit, str] = {"flops": "FLOP", "device_seconds": "device-s"}
"""A unit's name in a table header or an axis label."""


def device_time(seconds: float, *more: float, unit_of: float | None = None) -> str:
    """Accelerator time as people count it (the curve's axis; GPU-seconds on GPUs): seconds for short runs,
    hours (the paper's GPU-hours) else, chosen by the first value or by ``unit_of`` (e.g. the total of a
    line's parts). ``more`` (an interval's ends) follow in the same unit: "1.64 device-hours", "201 [150,
    260] device-s"."""
    hours = (seconds if unit_of is None else unit_of) >= 360

    def shown(x: float) -> str:
        return f"{x / 3600:,.2f}" if hours else f"{x:,.0f}"

    ends = f" [{', '.join(shown(x) for x in more)}]" if more else ""
    return f"{shown(seconds)}{ends} {'device-hours' if hours else 'device-s'}"


class ComputeMeter:
    """Accumulates one instance's FLOPs and device time and publishes them.

    ``num_params`` is N (``flop_params`` of the model served or trained); 0 counts no FLOPs.
    """

    def __init__(self, service: str, instance_id: str, device_kind: str, num_devices: int, num_params: int = 0) -> None:
        self.service = service
        self.instance_id = instance_id
        self.device_kind = device_kind
        self.num_devices = num_devices
        self.num_params = num_params
        self._start = time.monotonic()
        self.busy_seconds = 0.0
        self.num_tokens = 0
        self.num_eval_tokens = 0
        """Of num_tokens, those sampled for eval rounds."""
        self.flops = 0.0
        self.eval_flops = 0.0
        """Of flops, those of eval rounds' tokens."""
        self.policy_version = 0
        self.eval_device_seconds = 0.0
        self._split_at = (0.0, 0, 0)
        """(device-seconds, tokens, eval tokens) when the eval share was last split off."""

    def add_busy(self, seconds: float, num_tokens: int = 0) -> None:
        self.busy_seconds += seconds
        self.num_tokens += num_tokens

    def add_tokens(self, num_tokens: int, eval: bool = False, num_processed: int | None = None) -> None:
        """A generator's task: ``num_tokens`` sampled, ``num_processed`` (default: those) run through the
        model once each, prompt and injected tokens included, at 2N FLOPs a token."""
        self.num_tokens += num_tokens
        flops = float(
            FORWARD_FLOPS_PER_PARAM * self.num_params * (num_tokens if num_processed is None else num_processed)
        )
        self.flops += flops
        if eval:
            self.num_eval_tokens += num_tokens
            self.eval_flops += flops

    def add_trained(self, num_tokens: int, backward: bool = True) -> None:
        """A learner's step over ``num_tokens`` (prompts and completions, padding not counted): 6N FLOPs a
        token, or 2N for a step whose loss held nothing (forward only)."""
        per_param = TRAIN_FLOPS_PER_PARAM if backward else FORWARD_FLOPS_PER_PARAM
        self.flops += float(per_param * self.num_params * num_tokens)

    def _split_eval(self, device_seconds: float) -> float:
        """Eval device-seconds so far: each interval since the last split adds its device time x the eval
        share of its tokens (an interval with no tokens adds none), so the total only grows."""
        last_s, last_tokens, last_eval = self._split_at
        tokens = self.num_tokens - last_tokens
        if tokens > 0:
            share = (self.num_eval_tokens - last_eval) / tokens
            self.eval_device_seconds += max(device_seconds - last_s, 0.0) * min(max(share, 0.0), 1.0)
            self._split_at = (device_seconds, self.num_tokens, self.num_eval_tokens)
        elif device_seconds > last_s:
            self._split_at = (device_seconds, self.num_tokens, self.num_eval_tokens)
        return self.eval_device_seconds

    def snapshot(self, unix_s: float | None = None) -> rollout_pb2.ComputeTelemetry:
        """The totals now, stamped ``unix_s`` (default: now), e.g. the moment a policy version was published."""
        device_seconds = (time.monotonic() - self._start) * self.num_devices
        return rollout_pb2.ComputeTelemetry(
            service=self.service,
            instance_id=self.instance_id,
            device_kind=self.device_kind,
            num_devices=self.num_devices,
            device_seconds_total=device_seconds,
            busy_seconds_total=self.busy_seconds,
            unix_s=time.time() if unix_s is None else unix_s,
            policy_version=self.policy_version,
            num_tokens_total=self.num_tokens,
            eval_device_seconds_total=self._split_eval(device_seconds),
            flops_total=self.flops,
            eval_flops_total=self.eval_flops,
            num_params=self.num_params,
        )

    async def publish(self, js: JetStreamContext, names: Names, unix_s: float | None = None) -> None:
        await js.publish(names.telemetry, self.snapshot(unix_s).SerializeToString())

    async def publish_version(self, js: JetStreamContext, names: Names, version: int, published_unix_s: float) -> None:
        """Report the totals as ``version`` is published, stamped with its publication: the FLOPs the fitter
        reads at that moment are then the ones counted up to it, not an interpolation. A failure is logged."""
        self.policy_version = version
        try:
            await self.publish(js, names, published_unix_s)
        except Exception as exc:  # monitoring must not kill the service
            log.warning("compute telemetry of version %d not published: %s", version, exc)

    async def run(self, js: JetStreamContext, names: Names, stop: asyncio.Event, interval_s: float) -> None:
        """Publish every ``interval_s`` until stop, then once more."""
        while not stop.is_set():
            try:
                await self.publish(js, names)
            except Exception as exc:  # monitoring must not kill the service
                log.warning("compute telemetry not published: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass
        try:
            await self.publish(js, names)
        except Exception as exc:
            log.warning("final compute telemetry not published: %s", exc)
