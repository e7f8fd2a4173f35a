"""Math and code in one run: the words+code workload on the local stack.

A mixture of the word problems answered in a box (math-verify) and the same
problems answered by a Python program run in the sandbox (the code
verifier), half and half. A few steps cannot be relied on to learn, so
what is asserted is the path: the learner trains every step, each eval
round is one per sub-task with rows tagged by it, the fitter
keeps a curve and a fit of each, the summary names each one's held-out
pass rate, and the ledger accounts for every task.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from services.local.progress import read_jsonl

MAX_STEPS = 4
EVERY = 2


@pytest.mark.e2e
# A fresh clone builds the mixture's warm start first (its own BPE tokenizer and both formats): the run
# took 638 s there beside the fault suite, past the suite's 10-minute limit per test.
@pytest.mark.timeout(1500)
def test_a_mixed_run_keeps_a_curve_and_a_fit_per_sub_task(launch: Callable[..., Any]) -> None:
    with launch(
        **{
            "workload": "words+code",
            "max_steps": MAX_STEPS,
            "eval_every_versions": EVERY,
            "eval_num_samples": 1,
            "checkpoint_every_steps": EVERY,
            "batch_prompts": 8,
            "group_size": 4,
            "zero_variance": "keep",  # every group trains: the steps do not wait on lucky groups
            # A shorter warm start than the default's: this run checks the path, not the skill.
            "warmstart": {"max_steps": 100},
        }
    ) as (stack, progress):
        assert stack.follow() == 0, progress.outcome
        run_dir = stack.run_dir
    evals = read_jsonl(run_dir / "eval.jsonl")
    versions = list(range(0, MAX_STEPS + 1, EVERY))
    assert Counter(e["task"] for e in evals) == {"words": len(versions), "code": len(versions)}
    for task in ("words", "code"):
        assert sorted(e["policy_version"] for e in evals if e["task"] == task) == versions
    fit = json.loads((run_dir / "fit.json").read_text())
    assert set(fit["tasks"]) == {"words", "code"}
    assert all(fit["tasks"][t]["num_points"] == len(versions) for t in ("words", "code"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["heldout_by_task"]) == {"words", "code"} and set(summary["fit"]["tasks"]) == {"words", "code"}
    for task in ("words", "code"):
        rows = [e for e in evals if e["task"] == task]
        assert summary["heldout_by_task"][task]["heldout_pass_rate_final"] == rows[-1]["pass_rate"]
    ledger = summary["ledger"]
    assert (ledger["lost"], ledger["trained_twice"]) == (0, 0)
    assert ledger["trained"] == MAX_STEPS * 8
