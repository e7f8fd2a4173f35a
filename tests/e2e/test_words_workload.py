"""The embedded default, the word-problem workload, runs on the local stack.

The tiny BPE model, warm-started on the shipped word problems' worked
solutions (cached like the arithmetic default's), thinks and answers in
``\\boxed{}`` under interruption length control; math-verify scores it in
the generator's pool. A short run cannot be relied on to learn, so what is
asserted is that the real-task path runs: the learner steps, new versions
reach the generator, thinking budgets interrupt completions from the first
steps on, and the summary reports the interruption and truncation rates
that the steps' metrics add up to.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from asymptote.tasks import LengthControlSettings
from services.local.config import words_task
from services.local.progress import length_rates, read_jsonl

MAX_STEPS = 6
SHORT_BUDGETS = LengthControlSettings(thinking_budget_tokens=(8, 40), answer_budget_tokens=16)


def gauge(prom: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", prom, re.MULTILINE)
    assert match, f"{name} not in the exposition"
    return float(match.group(1))


@pytest.mark.e2e
def test_the_word_problem_workload_runs_with_length_control(launch: Callable[..., Any]) -> None:
    with launch(
        **{
            "workload": "words",
            # Budgets of 8-40 tokens against thinking of 16-23: the first steps interrupt for certain
            # (the default's 16-64 interrupts about one group in eight).
            "task": words_task().model_copy(update={"length_control": SHORT_BUDGETS}),
            "max_steps": MAX_STEPS,
            "eval_every_versions": MAX_STEPS,
            "eval_num_samples": 1,
            "checkpoint_every_steps": MAX_STEPS,
            "batch_prompts": 8,
            "group_size": 4,
            "zero_variance": "keep",  # every group trains: the steps do not wait on lucky groups
            # A shorter warm start than the default's (about 350 steps): the format (thinking, then a
            # boxed answer) is learned in the first hundred, and this run checks the path, not the skill.
            "warmstart": {"max_steps": 100},
        }
    ) as (stack, progress):
        model_dir = Path(
            yaml.safe_load((stack.run_dir / "config" / "generator-0.yaml").read_text())["engine"]["model_dir"]
        )
        meta = json.loads((model_dir / "warmstart.json").read_text())
        assert meta["task"]["name"] == "dataset" and meta["num_steps"] >= 1
        assert stack.follow() == 0, progress.outcome
        stack.save_final_metrics()
        run_dir = stack.run_dir
        steps = read_jsonl(run_dir / "metrics.jsonl")
        assert [s["step"] for s in steps] == list(range(1, MAX_STEPS + 1))
        assert max(s["batch/max_token_version"] for s in steps) >= 1
        generator = (run_dir / "metrics" / "generator-0.prom").read_text()
        assert gauge(generator, "asymptote_generator_policy_version") == MAX_STEPS
    early = steps[:3]
    assert sum(s["rollout/interrupted"] for s in early) > 0
    # Every trained completion was counted among those generated (the rates' denominator).
    assert sum(s["batch/samples"] for s in steps) == MAX_STEPS * 8 * 4
    assert sum(s["rollout/completions"] for s in steps) >= MAX_STEPS * 8 * 4
    summary = json.loads((run_dir / "summary.json").read_text())
    rates = length_rates(steps)
    assert summary["length"] == rates
    assert 0.0 < summary["length"]["interruption_rate"] < 1.0
    assert summary["length"]["truncation_rate"] is not None and 0.0 <= summary["length"]["truncation_rate"] < 1.0
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["policy_version"] for e in evals] == [0, MAX_STEPS]
