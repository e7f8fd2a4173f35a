"""The compute axis: cumulative FLOPs of the whole run's training, and the device-seconds it held.

Owns integrating every instance's telemetry (generators and learner, any
number of them coming and going) into run totals, and remembering them at
the moment each policy version was published, which is the x value of an
eval of that version. Two totals are kept side by side:

- **FLOPs** (the curve's axis): the work of the tokens processed, counted
  by the services from token counts (``asymptote.compute``). A moment
  between two reports of an instance gets its value interpolated between
  them; a moment after its latest report, that report carried on at the
  rate of its last interval (for at most ``stale_s``), so a version marked
  as it is published is not short of the seconds since the last report.
  The same tokens give the same total however long they took.
- **Device-seconds held** (the run's cost): each instance's devices times
  its wall time, carried on with the devices held after its report.

The x values it hands out never decrease as the version grows, so the
curve's compute axis is monotone even when a version's publication was
missed and its value had to come from a later moment. What generators spent
sampling eval rounds is left out of both and kept apart (``eval`` in
``by_service`` and ``flops_by_service``): it measures the policy, not
trains it.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from asymptote.compute import ComputeUnit
from asymptote.contracts.v1 import rollout_pb2

HISTORY_REPORTS = 720
"""Reports kept per instance for interpolation: an hour at the default 5 s interval, far more than a
version mark or an eval round lags behind."""


class AxisValue(NamedTuple):
    """The run's training compute at one moment, in both units."""

    flops: float
    device_seconds: float

    def of(self, unit: ComputeUnit) -> float:
        """The value in ``unit``."""
        return self.flops if unit == "flops" else self.device_seconds


@dataclass
class _Instance:
    service: str
    num_devices: int
    device_seconds: float
    unix_s: float
    eval_device_seconds: float = 0.0
    num_params: int = 0
    flops: float = 0.0
    eval_flops: float = 0.0
    times: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY_REPORTS))
    """Report times, ascending; ``train_flops`` holds each one's FLOPs less eval's."""
    train_flops: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY_REPORTS))

    def flops_at(self, at_unix_s: float, stale_s: float) -> float:
        """Training FLOPs at a moment: interpolated between the reports around it, else the nearest report
        carried on (or back) at the rate of the interval next to it, never below 0, and on for at most that
        interval's length or ``stale_s``: an instance that stopped reporting is not counted working for long."""
        times, values = self.times, self.train_flops
        i = bisect.bisect_right(times, at_unix_s)
        if 0 < i < len(times):
            t0, t1, f0, f1 = times[i - 1], times[i], values[i - 1], values[i]
            return f0 + (f1 - f0) * (at_unix_s - t0) / (t1 - t0)
        edge, inner = (len(times) - 1, len(times) - 2) if i else (0, 1)
        if len(times) < 2:
            return values[edge]
        interval = abs(times[edge] - times[inner])
        rate = abs(values[edge] - values[inner]) / interval
        elapsed = at_unix_s - times[edge]
        return max(values[edge] + rate * (min(elapsed, stale_s, interval) if elapsed > 0 else elapsed), 0.0)


class ComputeAxis:
    """The sums over instances of their latest cumulative FLOPs and device-seconds.

    Each instance (a generator or learner process) reports its own totals;
    an instance is known by its id, so any number may join, leave or
    restart (a restart has a new id) and the sums integrate the changing
    number of devices over time.
    """

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self._instances: dict[str, _Instance] = {}
        self._published: dict[int, float] = {}
        """When each version was published, as marked (first mark wins); its totals are read when first asked
        for, so that the reports of that moment have come in (the learner reports as it announces a version,
        a moment the policy watch may see first)."""
        self._at_version: dict[int, AxisValue] = {}

    def observe(self, t: rollout_pb2.ComputeTelemetry) -> None:
        """Take one telemetry sample; an older total of a known instance is ignored."""
        known = self._instances.get(t.instance_id)
        if known is not None and (t.device_seconds_total < known.device_seconds or t.flops_total < known.flops):
            return  # out of order: totals only grow
        inst = known or _Instance(t.service, t.num_devices, 0.0, t.unix_s)
        inst.service, inst.num_devices, inst.unix_s = t.service, t.num_devices, t.unix_s
        inst.device_seconds = t.device_seconds_total
        inst.eval_device_seconds = min(max(t.eval_device_seconds_total, 0.0), t.device_seconds_total)
        inst.num_params = int(t.num_params)
        inst.flops = t.flops_total
        inst.eval_flops = min(max(t.eval_flops_total, 0.0), t.flops_total)
        if inst.times and t.unix_s <= inst.times[-1]:
            inst.train_flops[-1] = max(inst.train_flops[-1], inst.flops - inst.eval_flops)  # same moment: the newer
        else:
            inst.times.append(t.unix_s)
            inst.train_flops.append(inst.flops - inst.eval_flops)
        self._instances[t.instance_id] = inst

    def flops(self, at_unix_s: float) -> float:
        """Training FLOPs at a moment, over every instance (``_Instance.flops_at``); eval rounds' left out."""
        return sum(inst.flops_at(at_unix_s, self.stale_s) for inst in list(self._instances.values()))

    def device_seconds(self, at_unix_s: float) -> float:
        """Device-seconds held at a moment, from each instance's latest report.

        An instance holds its devices the whole time it runs, so its total
        moves with wall time: after its report it is extrapolated (held
        devices x elapsed), for at most ``stale_s`` (one silent for longer
        died or left); before its report it is taken back the same way, to
        zero for an instance that had not started yet. A moment in the past
        (a version mark processed late) thus gets the total it had then.
        Eval sampling time is left out: from an instance's latest report on,
        or back to zero before it.
        """
        total = 0.0
        for inst in list(self._instances.values()):
            elapsed = at_unix_s - inst.unix_s
            if elapsed >= 0:
                total += inst.device_seconds - inst.eval_device_seconds + min(elapsed, self.stale_s) * inst.num_devices
            else:
                train = inst.device_seconds - inst.eval_device_seconds
                total += max(train + elapsed * inst.num_devices, 0.0)
        return total

    def total(self, at_unix_s: float) -> AxisValue:
        """Both totals at a moment."""
        return AxisValue(self.flops(at_unix_s), self.device_seconds(at_unix_s))

    def eval_total(self) -> float:
        """Reported device-seconds spent sampling eval rounds, over every instance (off the axis)."""
        return sum(inst.eval_device_seconds for inst in list(self._instances.values()))

    def by_service(self) -> dict[str, float]:
        """Reported device-seconds held per service (no extrapolation); generators' eval sampling under ``eval``."""
        out: dict[str, float] = {}
        for inst in list(self._instances.values()):
            out[inst.service] = out.get(inst.service, 0.0) + inst.device_seconds - inst.eval_device_seconds
            if inst.eval_device_seconds > 0:
                out["eval"] = out.get("eval", 0.0) + inst.eval_device_seconds
        return out

    def flops_by_service(self) -> dict[str, float]:
        """Reported FLOPs per service (no extrapolation); eval rounds' under ``eval``."""
        out: dict[str, float] = {}
        for inst in list(self._instances.values()):
            out[inst.service] = out.get(inst.service, 0.0) + inst.flops - inst.eval_flops
            if inst.eval_flops > 0:
                out["eval"] = out.get("eval", 0.0) + inst.eval_flops
        return out

    def num_params(self) -> dict[str, int]:
        """N as each service reports it (the largest over its instances; 0: it counts no FLOPs)."""
        out: dict[str, int] = {}
        for inst in list(self._instances.values()):
            out[inst.service] = max(out.get(inst.service, 0), inst.num_params)
        return out

    @property
    def num_instances(self) -> int:
        return len(self._instances)

    def mark_version(self, version: int, published_unix_s: float) -> None:
        """Record the moment ``version`` was published (first mark wins)."""
        self._published.setdefault(version, published_unix_s)

    def at_version(self, version: int, fallback_unix_s: float) -> AxisValue:
        """The compute of ``version``: the totals at the moment it was published, else at ``fallback_unix_s``
        (e.g. when its eval finished) for a version whose mark was missed; fixed once asked for, and kept
        between its neighbours' values."""
        if version not in self._at_version:
            self._pin(version, self.total(self._published.get(version, fallback_unix_s)))
        return self._at_version[version]

    def _pin(self, version: int, value: AxisValue) -> None:
        # A version whose publication was missed takes its value from a later
        # moment (its eval), which can exceed a later version's mark: clamp
        # into its neighbours' range so compute never decreases with version.
        pinned = []
        for i in range(len(value)):
            lower = max((v[i] for k, v in self._at_version.items() if k < version), default=0.0)
            upper = min((v[i] for k, v in self._at_version.items() if k > version), default=math.inf)
            pinned.append(min(max(value[i], lower), upper))
        self._at_version[version] = AxisValue(*pinned)
