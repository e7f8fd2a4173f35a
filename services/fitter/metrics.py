"""The fitter's Prometheus export: one collector, one consistent snapshot.

Every scrape reads the current projection object once, so A, its bounds,
B, C_mid and the projections in one scrape always come from the same fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from asymptote.contracts.v1 import services_pb2


class ProjectionCollector(Collector):
    def __init__(
        self,
        run: str,
        snapshot: Callable[[], services_pb2.Projection],
        points: Callable[[], tuple[int, float, float]],
        compute: Callable[[], dict[str, float]],
    ) -> None:
        self.run = run
        self.snapshot = snapshot
        self.points = points
        self.compute = compute

    def collect(self) -> Iterator[GaugeMetricFamily]:
        p = self.snapshot()
        num_points, last_compute, last_pass_rate = self.points()
        labels = ["run"]

        def gauge(name: str, doc: str, value: float, extra: dict[str, str] | None = None) -> GaugeMetricFamily:
            keys = labels + sorted(extra or {})
            g = GaugeMetricFamily(f"asymptote_fitter_{name}", doc, labels=keys)
            g.add_metric([self.run, *[(extra or {})[k] for k in sorted(extra or {})]], value)
            return g

        yield gauge("fit_ok", "1 if the last fit succeeded", 1.0 if p.ok else 0.0)
        yield gauge("points", "Validation points collected", float(num_points))
        yield gauge("last_pass_rate", "Latest validation pass rate", last_pass_rate)
        yield gauge("last_compute", "Compute (accelerator-seconds) of the latest point", last_compute)
        for service, seconds in sorted(self.compute().items()):
            yield gauge("compute_seconds", "Cumulative accelerator-seconds by service", seconds, {"service": service})
        if not p.ok:
            return
        yield gauge("r0", "Pass rate before RL (R0)", p.r0)
        yield gauge("points_used", "Points used by the last fit", float(p.num_points_used))
        yield gauge("rmse", "RMSE of the last fit", p.rmse)
        yield gauge("last_fit_unix_seconds", "Time of the last successful fit", p.fitted_unix_s)
        for name, value, iv in (("a", p.a, p.a_interval), ("b", p.b, p.b_interval), ("c_mid", p.c_mid, p.c_mid_interval)):
            yield gauge(name, f"Fitted {name}", value)
            yield gauge(f"{name}_low", f"Lower bound of {name}", iv.low)
            yield gauge(f"{name}_high", f"Upper bound of {name}", iv.high)
        proj = GaugeMetricFamily(
            "asymptote_fitter_projected_pass_rate", "Projected pass rate at a target compute",
            labels=["run", "compute", "bound"],
        )
        for v in p.projections:
            c = f"{v.compute:.6g}"
            proj.add_metric([self.run, c, "mid"], v.pass_rate)
            proj.add_metric([self.run, c, "low"], v.interval.low)
            proj.add_metric([self.run, c, "high"], v.interval.high)
        yield proj


def registry_with(collector: ProjectionCollector) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(collector)
    return r
