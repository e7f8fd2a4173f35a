"""The compute axis: cumulative accelerator-seconds of the whole run.

Owns integrating every instance's telemetry (generators and learner, any
number of them coming and going) into one total, and remembering the total
at the moment each policy version was published, which is the x value of
an eval of that version.
"""

from __future__ import annotations

from dataclasses import dataclass

from asymptote.contracts.v1 import rollout_pb2


@dataclass
class _Instance:
    service: str
    num_devices: int
    device_seconds: float
    unix_s: float


class ComputeAxis:
    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s
        self._instances: dict[str, _Instance] = {}
        self._at_version: dict[int, float] = {}

    def observe(self, t: rollout_pb2.ComputeTelemetry) -> None:
        known = self._instances.get(t.instance_id)
        if known is not None and t.device_seconds_total < known.device_seconds:
            return  # out of order: totals only grow
        self._instances[t.instance_id] = _Instance(t.service, t.num_devices, t.device_seconds_total, t.unix_s)

    def total(self, at_unix_s: float) -> float:
        """Total device-seconds at a moment, extrapolating live instances.

        An instance that reported within ``stale_s`` is assumed to have held
        its devices since; one silent for longer is counted only up to its
        last report plus ``stale_s`` (it died or left).
        """
        total = 0.0
        for inst in self._instances.values():
            ahead = min(max(at_unix_s - inst.unix_s, 0.0), self.stale_s)
            total += inst.device_seconds + ahead * inst.num_devices
        return total

    def by_service(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for inst in self._instances.values():
            out[inst.service] = out.get(inst.service, 0.0) + inst.device_seconds
        return out

    @property
    def num_instances(self) -> int:
        return len(self._instances)

    def mark_version(self, version: int, published_unix_s: float) -> None:
        self._at_version.setdefault(version, self.total(published_unix_s))

    def at_version(self, version: int, fallback_unix_s: float) -> float:
        if version not in self._at_version:
            self._at_version[version] = self.total(fallback_unix_s)
        return self._at_version[version]
