"""The sweep controller's Prometheus export: one collector over the controller's latest summary.

Every scrape reads one ``sweep.json`` summary (``Controller.summary``, the dict the controller last wrote),
so the arms' states, the decisions, the compute and each arm's A in one scrape are one moment's. Every
state and outcome is exported from the start, at 0 where none is: a rate or ``increase`` sees only series
that existed before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.sweep.controller import RunState
from services.sweep.rule import Outcome

RUN_STATES: tuple[str, ...] = get_args(RunState)
OUTCOMES: tuple[str, ...] = get_args(Outcome)


class SweepCollector(Collector):
    """Gauges and counters of one sweep, from ``summary()`` (the latest sweep.json summary)."""

    def __init__(self, summary: Callable[[], Mapping[str, Any]]) -> None:
        self.summary = summary

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.summary()
        arms = s["arms"]
        by_arm = GaugeMetricFamily("asymptote_sweep_arms", "Arms by status", labels=["state"])
        by_run = GaugeMetricFamily("asymptote_sweep_runs", "Runs (arm x seed) by status", labels=["state"])
        runs = [r for a in arms for r in a["runs"]]
        for state in RUN_STATES:
            by_arm.add_metric([state], float(sum(a["status"] == state for a in arms)))
            by_run.add_metric([state], float(sum(r["status"] == state for r in runs)))
        yield by_arm
        yield by_run
        decisions = CounterMetricFamily(
            "asymptote_sweep_decisions", "Decisions logged at the arms' looks, by outcome", labels=["outcome"]
        )
        counts = s.get("decision_counts", {})
        for outcome in OUTCOMES:
            decisions.add_metric([outcome], float(counts.get(outcome, 0)))
        yield decisions
        compute = GaugeMetricFamily(
            "asymptote_sweep_compute_flops",
            "Compute on the fitter's axis: spent so far, planned (every run to its budget), saved (the budget "
            "stopped and skipped runs did not spend)",
            labels=["kind"],
        )
        for kind in ("spent", "planned", "saved"):
            compute.add_metric([kind], float(s["compute_by_kind"][kind]))
        yield compute
        yield GaugeMetricFamily(
            "asymptote_sweep_device_seconds", "Device-seconds the runs held", value=float(s["device_seconds"])
        )
        a = GaugeMetricFamily("asymptote_sweep_arm_a", "Each arm's fitted A and its interval", labels=["arm", "bound"])
        determined = GaugeMetricFamily(
            "asymptote_sweep_arm_determined", "1 if the arm's fit is determined", labels=["arm"]
        )
        stopped = GaugeMetricFamily("asymptote_sweep_arm_stopped", "1 if the rule stopped the arm", labels=["arm"])
        for arm in arms:
            fit = arm["fit"]
            if fit is not None:
                for bound, key in (("fit", "a"), ("low", "a_low"), ("high", "a_high")):
                    if fit.get(key) is not None:
                        a.add_metric([arm["name"], bound], float(fit[key]))
            determined.add_metric([arm["name"]], float(bool(fit and fit.get("determined"))))
            stopped.add_metric([arm["name"]], float(arm["action"] == "stop"))
        yield a
        yield determined
        yield stopped
