"""Labelled counters the alerts and dashboard read are exported at 0 from the
start: a rate or ``increase`` only sees an increment on a series that existed
before it, so the first refused swap or dead letter would otherwise go unseen.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.broker.metrics import BrokerMetrics
from services.generator.metrics import SWAP_REFUSALS, GeneratorMetrics

REPO = Path(__file__).resolve().parents[1]


def samples(registry: object, name: str, label: str) -> dict[str, float]:
    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    return {
        s.labels[label]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_a_fresh_generator_exports_every_refusal_reason_and_refused_tasks_at_zero() -> None:
    registry = GeneratorMetrics().registry
    assert samples(registry, "asymptote_generator_swaps_refused_total", "reason") == dict.fromkeys(SWAP_REFUSALS, 0.0)
    assert samples(registry, "asymptote_generator_task_errors_total", "reason") == {
        "poison": 0.0,
        "task_digest": 0.0,
        "no_sequence": 0.0,
        "routing": 0.0,
    }


def test_the_refusal_reasons_are_the_ones_the_swapper_counts() -> None:
    source = (REPO / "services" / "generator" / "swapper.py").read_text()
    assert set(re.findall(r'swaps_refused\.labels\("(\w+)"\)', source)) == set(SWAP_REFUSALS)


def test_a_fresh_broker_exports_dead_lettered_rollouts_at_zero() -> None:
    metrics = BrokerMetrics()
    assert samples(metrics.registry, "asymptote_broker_deadlettered_total", "source") == {"rollouts": 0.0}
    metrics.deadlettered.labels("rollouts").inc()
    assert samples(metrics.registry, "asymptote_broker_deadlettered_total", "source") == {"rollouts": 1.0}
