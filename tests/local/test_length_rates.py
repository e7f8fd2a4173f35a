"""The interruption and truncation rates, from the broker's batch header to the run's summary.

The broker counts every completion it receives before any filter and hands
the counts out with each batch; the learner turns them into the step's
``rollout/*`` metrics, and the local stack's summary sums them over the run,
beside the truncation rate of what was trained (after the filter).
"""

from __future__ import annotations

import pytest

from asymptote.contracts.v1 import services_pb2
from services.learner.loop import rollout_rates
from services.local.progress import length_rates


def test_step_rates_come_from_the_header_counts() -> None:
    header = services_pb2.BatchHeader(num_completions=40, num_interrupted=10, num_truncated=6)
    assert rollout_rates(header) == {
        "rollout/completions": 40.0,
        "rollout/interrupted": 10.0,
        "rollout/truncated": 6.0,
        "rollout/interruption_rate": 0.25,
        "rollout/truncation_rate": 0.15,
    }
    # No completion arrived since the previous batch: rates 0, not a division by zero.
    assert rollout_rates(services_pb2.BatchHeader())["rollout/truncation_rate"] == 0.0


def test_run_rates_weigh_each_step_by_its_completions() -> None:
    steps = [
        {**rollout_rates(services_pb2.BatchHeader(num_completions=40, num_interrupted=10, num_truncated=6)),
         "batch/samples": 16.0, "batch/truncation_rate": 0.0},
        {**rollout_rates(services_pb2.BatchHeader(num_completions=10, num_interrupted=5, num_truncated=4)),
         "batch/samples": 16.0, "batch/truncation_rate": 0.125},
    ]  # fmt: skip
    rates = length_rates(steps)
    assert rates["interruption_rate"] == pytest.approx(15 / 50)
    assert rates["truncation_rate"] == pytest.approx(10 / 50)
    # After the filter (all-truncated groups are flat, so dropped) the trained rate is lower.
    assert rates["trained_truncation_rate"] == pytest.approx(2 / 32)
    # A run from before these counts existed reports none.
    assert length_rates([{"batch/samples": 8.0, "batch/truncation_rate": 0.5}])["truncation_rate"] is None
