"""Math and code in one run: the words+code workload on the local stack.

A mixture of the word problems answered in a box (math-verify, under
interruption length control) and the same problems answered by a Python
program run in the sandbox (the code verifier), half and half. A few steps
cannot be relied on to learn, so what is asserted is the path: the learner
trains every step, new versions reach the generator, thinking budgets
interrupt word-problem completions from the first steps on and the summary
reports the interruption and truncation rates the steps' metrics add up
to, each eval round is one per sub-task with rows tagged by it, the fitter
keeps a curve and a fit of each, the summary names each one's held-out
pass rate, and the ledger accounts for every task.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from exposition import gauge

from asymptote.tasks import LengthControlSettings, MixtureEntry, MixtureSettings
from services.local.config import words_code_task, words_task
from services.local.progress import length_rates, read_jsonl

MAX_STEPS = 4
EVERY = 4
BATCH_PROMPTS, GROUP_SIZE = 8, 4
SHORT_BUDGETS = LengthControlSettings(thinking_budget_tokens=(8, 40), answer_budget_tokens=16)
"""Budgets of 8-40 tokens against thinking of 16-23: the first steps interrupt for certain (the default's
16-64 interrupts about one word-problem group in eight)."""


@pytest.mark.e2e
# A fresh clone builds the mixture's warm start first (its own BPE tokenizer and both formats).
@pytest.mark.timeout(1200)
def test_a_mixed_run_keeps_a_curve_and_a_fit_per_sub_task(launch: Callable[..., Any]) -> None:
    words = words_task().model_copy(update={"length_control": SHORT_BUDGETS})
    task = MixtureSettings(
        tasks=(
            MixtureEntry(name="words", weight=1.0, task=words),
            MixtureEntry(name="code", weight=1.0, task=words_code_task()),
        )
    )
    with launch(
        **{
            "workload": "words+code",
            "task": task,
            "max_steps": MAX_STEPS,
            "eval_every_versions": EVERY,
            "eval_num_samples": 1,
            "checkpoint_every_steps": EVERY,
            "batch_prompts": BATCH_PROMPTS,
            "group_size": GROUP_SIZE,
            "zero_variance": "keep",  # every group trains: the steps do not wait on lucky groups
            # A shorter warm start than the default's, probed once on a few problems: this run checks the
            # path, not the skill (the warm start's own probes and held-out pass rate are tested apart).
            "warmstart": {
                "max_steps": 60,
                "check_every_steps": 60,
                "num_probe_problems": 16,
                "eval_samples_per_prompt": 1,
            },
        }
    ) as (stack, progress):
        model_dir = Path(
            yaml.safe_load((stack.run_dir / "config" / "generator-0.yaml").read_text())["engine"]["model_dir"]
        )
        meta = json.loads((model_dir / "warmstart.json").read_text())
        assert meta["task"]["name"] == "mixture" and meta["num_steps"] >= 1
        assert stack.follow() == 0, progress.outcome
        stack.save_final_metrics()
        run_dir = stack.run_dir
        generator = (run_dir / "metrics" / "generator-0.prom").read_text()
        assert gauge(generator, "asymptote_generator_policy_version") == MAX_STEPS
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, MAX_STEPS + 1))
    assert max(s["batch/max_token_version"] for s in steps) >= 1
    assert sum(s["rollout/interrupted"] for s in steps[:3]) > 0
    # Every trained completion was counted among those generated (the rates' denominator).
    assert sum(s["batch/samples"] for s in steps) == MAX_STEPS * BATCH_PROMPTS * GROUP_SIZE
    assert sum(s["rollout/completions"] for s in steps) >= MAX_STEPS * BATCH_PROMPTS * GROUP_SIZE
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["length"] == length_rates(steps)
    assert 0.0 < summary["length"]["interruption_rate"] < 1.0
    assert summary["length"]["truncation_rate"] is not None and 0.0 <= summary["length"]["truncation_rate"] < 1.0

    evals = read_jsonl(run_dir / "eval.jsonl")
    versions = list(range(0, MAX_STEPS + 1, EVERY))
    assert Counter(e["task"] for e in evals) == {"words": len(versions), "code": len(versions)}
    for name in ("words", "code"):
        assert sorted(e["policy_version"] for e in evals if e["task"] == name) == versions
    fit = json.loads((run_dir / "fit.json").read_text())
    assert set(fit["tasks"]) == {"words", "code"}
    assert all(fit["tasks"][t]["num_points"] == len(versions) for t in ("words", "code"))
    assert set(summary["heldout_by_task"]) == {"words", "code"} and set(summary["fit"]["tasks"]) == {"words", "code"}
    for name in ("words", "code"):
        rows = [e for e in evals if e["task"] == name]
        assert summary["heldout_by_task"][name]["heldout_pass_rate_final"] == rows[-1]["pass_rate"]
    ledger = summary["ledger"]
    assert (ledger["lost"], ledger["trained_twice"]) == (0, 0)
    assert ledger["trained"] == MAX_STEPS * BATCH_PROMPTS
