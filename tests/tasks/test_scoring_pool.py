"""The scoring pool: a hostile completion costs its time limit, not the generator's progress."""

from __future__ import annotations

import asyncio
import time

import pytest

from asymptote.tasks.verifiers import ExactSettings, MathSettings, PluginSettings, Verdict
from asymptote.tasks.verifiers.pool import ScoringPool

TIMEOUT_S = 3.0
SLACK_S = 2.0
"""Past the limit: the pool's check interval (0.1 s) and a loaded machine's scheduling."""
POWER_TOWER = "\\boxed{9^{9^{9^{9^{9}}}}}"
"""sympy evaluates the tower exactly: it never finishes."""
NESTED = "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}"
"""Measured at about 34 s in math-verify on this machine."""
MEGABYTES = "blah " * 600_000 + "so \\boxed{5}"


@pytest.fixture
async def pool() -> ScoringPool:
    p = ScoringPool(MathSettings(), num_workers=2, timeout_s=TIMEOUT_S)
    # Both workers up (spawned, math-verify imported) before anything is timed.
    assert await p.judge_all(["\\boxed{1}", "\\boxed{2}"], "1") == [Verdict(True, "correct"), Verdict(False, "wrong")]
    p.counts.clear()
    yield p  # type: ignore[misc]
    p.close()


async def test_a_hostile_completion_times_out_while_the_others_are_scored(pool: ScoringPool) -> None:
    started = time.monotonic()
    hostile = asyncio.create_task(pool.judge(POWER_TOWER, "5"))
    normal = await pool.judge_all([f"\\boxed{{{i}}}" for i in range(10)], "5")
    normal_done_s = time.monotonic() - started
    assert not hostile.done(), "the other worker scored the group while the hostile one ran"
    assert normal == [Verdict(i == 5, "correct" if i == 5 else "wrong") for i in range(10)]
    assert normal_done_s < TIMEOUT_S
    assert await hostile == Verdict(False, "timeout")
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + SLACK_S
    assert pool.counts == {"correct": 1, "wrong": 9, "timeout": 1}
    # The killed worker is replaced: both workers score again.
    assert await pool.judge_all(["\\boxed{5}", "\\boxed{5}"], "5") == [Verdict(True, "correct")] * 2


async def test_nested_braces_and_megabytes_of_text(pool: ScoringPool) -> None:
    started = time.monotonic()
    nested, big = await asyncio.gather(pool.judge(NESTED, "1"), pool.judge(MEGABYTES, "5"))
    assert nested == Verdict(False, "timeout")
    assert big == Verdict(True, "correct")
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S
    assert pool.counts == {"correct": 1, "timeout": 1}


async def test_a_verifier_that_raises_scores_as_an_error_and_the_pool_goes_on() -> None:
    pool = ScoringPool(ExactSettings(), num_workers=1, timeout_s=TIMEOUT_S)
    try:
        # A reference that is not text makes the exact verifier raise inside the worker.
        assert await pool.judge("Paris", None) == Verdict(False, "error")  # type: ignore[arg-type]
        assert await pool.judge("Paris", "paris") == Verdict(True, "correct")
        assert pool.counts == {"error": 1, "correct": 1}
    finally:
        pool.close()


def test_bad_pool_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="num_workers must be at least 1"):
        ScoringPool(MathSettings(), num_workers=0)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        ScoringPool(MathSettings(), timeout_s=0)
    with pytest.raises(ValueError, match="no verifier entry point 'nope'"):
        ScoringPool(PluginSettings(entry_point="nope"))
