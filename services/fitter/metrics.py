"""The fitter's Prometheus export: one collector, one consistent snapshot.

Every scrape reads the collector's snapshot once (``collector.Snapshot``,
replaced whole after each refit), so A, its bounds, B, C_mid, the
projections, the points used and the time of the fit in one scrape always
come from the same fit. The fit gauges show the latest successful fit;
``asymptote_fitter_fit_ok`` says whether the latest attempt succeeded,
``asymptote_fitter_determined`` whether that fit is determined
(``decision.determination``; ``asymptote_fitter_not_determined{reason}``
says what keeps it from being so) and
``asymptote_fitter_last_fit_unix_seconds`` how old the fit shown is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import get_args

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.fitter.collector import Snapshot
from services.fitter.decision import MAX_C_MID_SPREAD, MIN_POINTS_DETERMINED, NOT_DETERMINED_KINDS, Action

PARAMS = ("A", "B", "C_mid")
"""The fitted parameters, as ``at_bound`` names them."""
ACTIONS: tuple[str, ...] = get_args(Action)
"""The recommendations (``decision.recommend``)."""


class ProjectionCollector(Collector):
    """Gauges of one run's projection, labelled ``run``."""

    def __init__(
        self,
        run: str,
        snapshot: Callable[[], Snapshot],
        compute: Callable[[], dict[str, float]],
        flops: Callable[[], dict[str, float]] = dict,
    ) -> None:
        self.run = run
        self.snapshot = snapshot
        self.compute = compute
        """Device-seconds held by service (the run's cost)."""
        self.flops = flops
        """FLOPs by service (the curve's axis)."""

    def _gauge(self, name: str, doc: str, value: float, extra: dict[str, str] | None = None) -> GaugeMetricFamily:
        keys = ["run", *sorted(extra or {})]
        gauge = GaugeMetricFamily(f"asymptote_fitter_{name}", doc, labels=keys)
        gauge.add_metric([self.run, *[(extra or {})[k] for k in sorted(extra or {})]], value)
        return gauge

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.snapshot()
        gauge = self._gauge
        yield gauge("fit_ok", "1 if the latest fit attempt succeeded, 0 if it was refused", float(snap.projection.ok))
        yield gauge("points", "Validation points collected (R0's included)", float(snap.num_points))
        yield gauge("last_pass_rate", "Latest validation pass rate", snap.last_pass_rate)
        yield gauge(
            "last_compute",
            "Compute of the latest point, in the curve's axis unit (FLOPs unless the run began on device-seconds)",
            snap.last_compute,
        )
        for service, seconds in sorted(self.compute().items()):
            yield gauge(
                "compute_seconds",
                "Cumulative accelerator-seconds held by service (the run's cost; eval: eval rounds' sampling)",
                seconds,
                {"service": service},
            )
        for service, flops in sorted(self.flops().items()):
            yield gauge(
                "compute_flops",
                "Cumulative FLOPs of the tokens processed by service (the curve's axis; eval: eval rounds')",
                flops,
                {"service": service},
            )
        if snap.half_run_projected is not None and snap.half_run_measured is not None:
            yield gauge(
                "half_run_projected_pass_rate",
                "Pass rate at the latest point's compute projected from the points at most half that compute",
                snap.half_run_projected,
            )
            yield gauge(
                "half_run_measured_pass_rate",
                "Pass rate measured at the latest point (what the half-run projection is compared with)",
                snap.half_run_measured,
            )
        p = snap.last_ok
        if p is None:
            return
        yield gauge("r0", "Pass rate before RL (R0) of the latest successful fit", p.r0)
        yield gauge("points_used", "Points used by the latest successful fit", float(p.num_points_used))
        yield gauge("rmse", "RMSE of the latest successful fit", p.rmse)
        yield gauge("last_fit_unix_seconds", "Time of the latest successful fit", p.fitted_unix_s)
        yield gauge(
            "identifiable",
            "1 if no parameter of the latest successful fit is at a bound of its search range, "
            "0 if one is (not yet identifiable: do not read its projection)",
            float(p.identifiable),
        )
        judged = snap.determination
        if judged is not None:
            yield gauge(
                "determined",
                f"1 if the latest successful fit is determined: at least {MIN_POINTS_DETERMINED} points, no "
                "parameter at a bound, A's interval inside A's search range, C_mid's interval at most "
                f"{MAX_C_MID_SPREAD:g}x wide; 0 if not (read neither A nor the projection)",
                float(judged.determined),
            )
            not_determined = GaugeMetricFamily(
                "asymptote_fitter_not_determined",
                f"1 for each reason the latest successful fit is not determined ({', '.join(NOT_DETERMINED_KINDS)})",
                labels=["run", "reason"],
            )
            kinds = {shortfall.kind for shortfall in judged.shortfalls}
            for kind in NOT_DETERMINED_KINDS:
                not_determined.add_metric([self.run, kind], float(kind in kinds))
            yield not_determined
        at_bound = GaugeMetricFamily(
            "asymptote_fitter_at_bound",
            "1 if the parameter ended on a bound of its search range in the latest successful fit",
            labels=["run", "param"],
        )
        for param in PARAMS:
            at_bound.add_metric([self.run, param], float(param in p.at_bound))
        yield at_bound
        recommendation = GaugeMetricFamily(
            "asymptote_fitter_recommendation",
            "1 for the latest successful fit's recommendation at the planned budget (continue, stop or compare)",
            labels=["run", "action"],
        )
        for action in ACTIONS:
            recommendation.add_metric([self.run, action], float(p.recommendation == action))
        yield recommendation
        for name, value, interval in (
            ("a", p.a, p.a_interval),
            ("b", p.b, p.b_interval),
            ("c_mid", p.c_mid, p.c_mid_interval),
        ):
            yield gauge(name, f"Fitted {name}", value)
            yield gauge(f"{name}_low", f"Lower bound of {name} (bootstrap interval)", interval.low)
            yield gauge(f"{name}_high", f"Upper bound of {name} (bootstrap interval)", interval.high)
        projected = GaugeMetricFamily(
            "asymptote_fitter_projected_pass_rate",
            "Projected pass rate at a target compute; target is budget at the planned budget, else multiple "
            "(a multiple of the compute spent)",
            labels=["run", "compute", "bound", "target"],
        )
        for projection in p.projections:
            compute = f"{projection.compute:.6g}"
            budget = p.HasField("planned_compute") and projection.compute == p.planned_compute
            target = "budget" if budget else "multiple"
            projected.add_metric([self.run, compute, "mid", target], projection.pass_rate)
            projected.add_metric([self.run, compute, "low", target], projection.interval.low)
            projected.add_metric([self.run, compute, "high", target], projection.interval.high)
        yield projected


class RunCollector(Collector):
    """Gauges of every curve of the run: one ``ProjectionCollector`` per curve (``series`` gives each
    curve's ``run`` label and snapshot: the run's, or ``run/sub-task`` for each sub-task of a mixture),
    their samples merged into one family per gauge."""

    def __init__(
        self,
        series: Callable[[], list[tuple[str, Callable[[], Snapshot]]]],
        compute: Callable[[], dict[str, float]],
        flops: Callable[[], dict[str, float]] = dict,
    ) -> None:
        self.series = series
        self.compute = compute
        self.flops = flops

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families: dict[str, GaugeMetricFamily] = {}
        for run, snapshot in self.series():
            for family in ProjectionCollector(run, snapshot, self.compute, self.flops).collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


def registry_with(collector: Collector) -> CollectorRegistry:
    """A registry holding only ``collector`` (the fitter's /metrics)."""
    registry = CollectorRegistry()
    registry.register(collector)
    return registry
