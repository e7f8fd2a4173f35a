"""The seed-spread figure's arithmetic (benchmarks/seeds.py) on runs of known shape.

The runs themselves take an hour or more (``python -m benchmarks.seeds``); what is checked here is what
turns their files into the figures: the sustained loss, the spread of A over determined fits only, the
eval rounds' share and standard error, the verdicts and the plot.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.seeds import figures, plot, read_run, sustained_loss

STEPS = list(range(0, 320, 20))


def test_a_dip_counts_from_the_round_it_falls_below_to_the_round_it_recovers() -> None:
    rates = [0.30, 0.40, 0.45, 0.38, 0.36, 0.37, 0.44, 0.46]  # below 0.45 - 0.05 at 60, 80, 100; back at 120
    versions = [0, 20, 40, 60, 80, 100, 120, 140]
    longest, deepest = sustained_loss(versions, rates, 0.05)
    assert longest == 120 - 60 and deepest == pytest.approx(0.45 - 0.36)
    # A fall of exactly the margin is not a loss; one that never recovers lasts to the last round.
    assert sustained_loss([0, 20, 40], [0.5, 0.45, 0.45], 0.05)[0] == 0
    assert sustained_loss([0, 20, 40, 60], [0.5, 0.3, 0.3, 0.3], 0.05)[0] == 60 - 20


def write_run(run_dir: Path, a: float | None, rates: list[float], *, samples: int = 800) -> Path:
    """A run's files as `asymptote up` writes them, with the fields the benchmark reads."""
    run_dir.mkdir(parents=True)
    determined = a is not None
    fit: dict[str, Any] = {"determined": determined, "r0": rates[0], "why_not_determined": "" if a else "at_bound"}
    if a is not None:
        fit |= {"a": a, "b": 1.5, "c_mid": 4e12, "a_interval": {"low": a - 0.02, "high": a + 0.02}}
    else:
        fit |= {"a_interval": {"low": 0.4, "high": 1.0}, "not_determined_point_estimates": {"a": 0.7, "b": 10.0}}
    (run_dir / "fit.json").write_text(json.dumps(fit))
    summary = {
        "outcome": "completed",
        "heldout_pass_rate_step0": rates[0],
        "heldout_pass_rate_final": rates[-1],
        "heldout_gain": rates[-1] - rates[0],
        "half_run_projection": {"verdict": "landed", "error": 0.01, "interval": [0.45, 0.5]},
        "length": {"max_window_truncation_rate": 0.02},
        "flops_by_service": {"learner": 8e12, "generator": 9e11, "eval": 1e11},
        "compute_by_service": {"learner": 400.0, "generator": 300.0, "eval": 60.0},
        "ledger": {"lost": 0, "trained_twice": 0},
        "total_wall_s": 900.0,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    rows = [
        {"policy_version": v, "compute": 6e10 * v, "pass_rate": r, "num_samples": samples} for v, r in zip(STEPS, rates)
    ]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def rising(top: float) -> list[float]:
    return [0.3 + (top - 0.3) * (1 - math.exp(-v / 80)) for v in STEPS]


def test_the_spread_is_over_determined_fits_and_each_figure_has_its_verdict(tmp_path: Path) -> None:
    runs = {s: read_run(write_run(tmp_path / f"s{s}", a, rising(a)), 0.05) for s, a in enumerate((0.50, 0.53, 0.52))}
    spread, loss, truncation, share, se = figures(runs, 0.05, 40)
    assert spread.value == pytest.approx(0.03) and spread.met is True
    assert loss.value == 0 and loss.met is True
    assert truncation.value == 0.02 and truncation.met is True
    assert share.value == pytest.approx(1e11 / 1e12) and share.met is True
    assert runs[0]["eval_share_device_seconds"] == pytest.approx(60 / 360)
    top = max(r * (1 - r) for r in rising(0.53))
    assert se.value == pytest.approx(math.sqrt(top / 800)) and se.met is True
    plot(runs, tmp_path / "seeds.png")
    assert (tmp_path / "seeds.png").stat().st_size > 10_000


def test_one_undetermined_fit_leaves_the_spread_unmeasured_and_missed(tmp_path: Path) -> None:
    runs = {0: read_run(write_run(tmp_path / "s0", 0.50, rising(0.5)), 0.05)}
    runs[1] = read_run(write_run(tmp_path / "s1", None, rising(0.5)), 0.05)
    spread = figures(runs, 0.05, 40)[0]
    assert spread.value is None and spread.met is False
    assert "not determined: seeds [1]" in spread.measured


def test_a_run_that_wanders_and_a_small_round_miss_their_targets(tmp_path: Path) -> None:
    wander = rising(0.5)
    wander[8:12] = [r - 0.12 for r in wander[8:12]]  # versions 160-220 well below the best, back at 240
    runs = {s: read_run(write_run(tmp_path / f"s{s}", 0.5, wander, samples=192), 0.05) for s in (0, 1)}
    _, loss, _, _, se = figures(runs, 0.05, 40)
    assert loss.value == 240 - 160 and loss.met is False
    assert se.value is not None and se.value > 0.02 and se.met is False
