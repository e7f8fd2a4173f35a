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
from services.local.progress import TRUNCATION_WINDOW_STEPS, length_rates, truncation_warning


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


def _steps(truncated: list[int], completions: int = 100) -> list[dict[str, float]]:
    return [rollout_rates(services_pb2.BatchHeader(num_completions=completions, num_truncated=n)) for n in truncated]


def test_a_climbing_truncation_rate_marks_the_run_unstable_and_says_so() -> None:
    # 2% for 60 steps, then 10 steps at 30%: the worst 20-step window holds those 10 and 10 at 2%.
    steps = _steps([2] * 60 + [30] * 10)
    rates = length_rates(steps)
    assert rates["max_window_truncation_rate"] == pytest.approx((10 * 30 + 10 * 2) / 2000)
    assert rates["unstable"]
    warning = truncation_warning(steps)
    assert warning is not None and warning.startswith("unstable: truncation rose from 2% to 16%")
    assert "max_tokens" not in warning  # a longer cap is not the cure for a policy that stopped stopping


def test_a_steady_low_truncation_rate_is_stable_and_silent() -> None:
    steps = _steps([4, 5, 3] * 30)  # 4% throughout
    rates = length_rates(steps)
    assert rates["max_window_truncation_rate"] == pytest.approx(0.04, abs=0.002)
    assert not rates["unstable"] and truncation_warning(steps) is None
    # A window of exactly 5% is unstable (the bound is included).
    assert length_rates(_steps([5] * TRUNCATION_WINDOW_STEPS))["unstable"]


def test_truncation_from_the_first_steps_blames_max_tokens() -> None:
    steps = _steps([90] * 30)
    assert truncation_warning(steps) is not None
    assert (
        truncation_warning(steps)
        == "90% of completions hit max_tokens, 90% from the start: max_tokens is short for the task"
    )
    assert length_rates([])["max_window_truncation_rate"] is None and not length_rates([])["unstable"]
