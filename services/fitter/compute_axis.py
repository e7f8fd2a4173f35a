"""The compute axis: cumulative accelerator-seconds of the whole run's training.

Owns integrating every instance's telemetry (generators and learner, any
number of them coming and going) into one total, and remembering the total
at the moment each policy version was published, which is the x value of
an eval of that version. The x values it hands out never decrease as the
version grows, so the curve's compute axis is monotone even when a
version's publication was missed and its value had to come from a later
moment. The time generators spent sampling eval rounds is left out of the
axis and kept apart (``eval_total``): it measures the policy, not trains it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from asymptote.contracts.v1 import rollout_pb2


@dataclass
class _Instance:
    service: str
    num_devices: int
    device_seconds: float
    unix_s: float
    eval_device_seconds: float = 0.0


class ComputeAxis:
    """The sum over instances of their latest cumulative device-seconds.

    Each instance (a generator or learner process) reports its own total;
    an instance is known by its id, so any number may join, leave or
    restart (a restart has a new id) and the sum integrates the changing
    number of devices over time.
    """

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self._instances: dict[str, _Instance] = {}
        self._at_version: dict[int, float] = {}

    def observe(self, t: rollout_pb2.ComputeTelemetry) -> None:
        """Take one telemetry sample; an older total of a known instance is ignored."""
        known = self._instances.get(t.instance_id)
        if known is not None and t.device_seconds_total < known.device_seconds:
            return  # out of order: totals only grow
        self._instances[t.instance_id] = _Instance(
            t.service,
            t.num_devices,
            t.device_seconds_total,
            t.unix_s,
            min(max(t.eval_device_seconds_total, 0.0), t.device_seconds_total),
        )

    def total(self, at_unix_s: float) -> float:
        """Total device-seconds at a moment, from each instance's latest report.

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

    def eval_total(self) -> float:
        """Reported device-seconds spent sampling eval rounds, over every instance (off the axis)."""
        return sum(inst.eval_device_seconds for inst in list(self._instances.values()))

    def by_service(self) -> dict[str, float]:
        """Reported device-seconds per service (no extrapolation); generators' eval sampling under ``eval``."""
        out: dict[str, float] = {}
        for inst in list(self._instances.values()):
            out[inst.service] = out.get(inst.service, 0.0) + inst.device_seconds - inst.eval_device_seconds
            if inst.eval_device_seconds > 0:
                out["eval"] = out.get("eval", 0.0) + inst.eval_device_seconds
        return out

    @property
    def num_instances(self) -> int:
        return len(self._instances)

    def mark_version(self, version: int, published_unix_s: float) -> None:
        """Record the total at the moment ``version`` was published (first mark wins)."""
        if version not in self._at_version:
            self._pin(version, self.total(published_unix_s))

    def at_version(self, version: int, fallback_unix_s: float) -> float:
        """The compute of ``version``: its mark, else the total at ``fallback_unix_s``
        (e.g. when its eval finished), kept between its neighbours' values."""
        if version not in self._at_version:
            self._pin(version, self.total(fallback_unix_s))
        return self._at_version[version]

    def _pin(self, version: int, value: float) -> None:
        # A version whose publication was missed takes its value from a later
        # moment (its eval), which can exceed a later version's mark: clamp
        # into its neighbours' range so compute never decreases with version.
        lower = max((v for k, v in self._at_version.items() if k < version), default=0.0)
        upper = min((v for k, v in self._at_version.items() if k > version), default=math.inf)
        self._at_version[version] = min(max(value, lower), upper)
