"""Compute accounting: each instance's cumulative accelerator time.

The curve's x-axis is training compute in accelerator-seconds (the paper's
GPU-hours), generators plus learner. Each instance publishes its own
cumulative total (wall seconds x devices held since it started, and the busy
part of it); the fitter sums the latest total of every instance ever seen,
which integrates over a changing number of generators. A generator also
reports the part of its time spent sampling eval rounds (each interval's
device time split by the tokens it sampled for each kind of task), which the
axis leaves out: measuring the policy is not training it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js import JetStreamContext

from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names

log = logging.getLogger(__name__)


def device_time(seconds: float, *more: float) -> str:
    """Accelerator time as people count it (the curve's axis; GPU-seconds on GPUs): seconds for short runs,
    hours (the paper's GPU-hours) else. ``more`` (an interval's ends) follow in the first value's unit:
    "1.64 device-hours", "201 [150, 260] device-s"."""
    hours = seconds >= 360

    def shown(x: float) -> str:
        return f"{x / 3600:,.2f}" if hours else f"{x:,.0f}"

    ends = f" [{', '.join(shown(x) for x in more)}]" if more else ""
    return f"{shown(seconds)}{ends} {'device-hours' if hours else 'device-s'}"


class ComputeMeter:
    """Accumulates one instance's device time and publishes it."""

    def __init__(self, service: str, instance_id: str, device_kind: str, num_devices: int) -> None:
        self.service = service
        self.instance_id = instance_id
        self.device_kind = device_kind
        self.num_devices = num_devices
        self._start = time.monotonic()
        self.busy_seconds = 0.0
        self.num_tokens = 0
        self.num_eval_tokens = 0
        """Of num_tokens, those sampled for eval rounds."""
        self.policy_version = 0
        self.eval_device_seconds = 0.0
        self._split_at = (0.0, 0, 0)
        """(device-seconds, tokens, eval tokens) when the eval share was last split off."""

    def add_busy(self, seconds: float, num_tokens: int = 0) -> None:
        self.busy_seconds += seconds
        self.num_tokens += num_tokens

    def add_tokens(self, num_tokens: int, eval: bool = False) -> None:
        self.num_tokens += num_tokens
        if eval:
            self.num_eval_tokens += num_tokens

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

    def snapshot(self) -> rollout_pb2.ComputeTelemetry:
        device_seconds = (time.monotonic() - self._start) * self.num_devices
        return rollout_pb2.ComputeTelemetry(
            service=self.service,
            instance_id=self.instance_id,
            device_kind=self.device_kind,
            num_devices=self.num_devices,
            device_seconds_total=device_seconds,
            busy_seconds_total=self.busy_seconds,
            unix_s=time.time(),
            policy_version=self.policy_version,
            num_tokens_total=self.num_tokens,
            eval_device_seconds_total=self._split_eval(device_seconds),
        )

    async def publish(self, js: JetStreamContext, names: Names) -> None:
        await js.publish(names.telemetry, self.snapshot().SerializeToString())

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
