"""``asymptote up --model DIR``: the local stack trains a user's model directory.

A random-initialised Qwen3 model directory (q/k norms; the arithmetic
task's character tokenizer) runs through the whole stack: the learner loads it through the Auto
classes, the generator's vLLM engine serves it, and each new version reaches
the generator. A random model earns no reward on the arithmetic task, so every
group is flat; under the default batch semantics (``zero_variance: drop``)
the broker still hands them out, so the learner steps and announces versions. What is asserted is the plumbing:
versions advance, the generator loads them (its gauge, and the versions on the
tokens of the groups it published), and the final eval round is sampled by the
final version.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from families import build

from services.local.progress import read_jsonl

MAX_STEPS = 4


def gauge(prom: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", prom, re.MULTILINE)
    assert match, f"{name} not in the exposition"
    return float(match.group(1))


@pytest.mark.e2e
# Llama is the built tiny model's family, which every other end-to-end run trains through the same
# model directory path. The stack's path is the same for every family past loading, which is where
# they differ: vLLM and the learner agree on Llama (untied head), Qwen2 (attention biases, tied head)
# and Qwen3 before and after a swap (tests/generator/test_architectures.py), so one family runs here.
@pytest.mark.parametrize("family", ["qwen3"])
def test_the_stack_trains_a_model_directory(family: str, launch: Callable[..., Any], tmp_path: Path) -> None:
    model_dir = build(family, tmp_path / family)
    with launch(
        model_dir=model_dir,
        max_steps=MAX_STEPS,
        eval_every_versions=MAX_STEPS,
        eval_num_samples=1,
        checkpoint_every_steps=MAX_STEPS,
        batch_prompts=4,
        group_size=2,
    ) as (stack, progress):
        assert stack.follow() == 0, progress.outcome
        stack.save_final_metrics()
        steps = read_jsonl(stack.run_dir / "metrics.jsonl")
        assert [s["step"] for s in steps] == list(range(1, MAX_STEPS + 1))
        # The generator loaded versions the learner made: later batches carry tokens they sampled.
        assert max(s["batch/max_token_version"] for s in steps) >= 1
        assert all(s["batch/max_token_version"] <= s["step"] - 1 for s in steps)
        evals = read_jsonl(stack.run_dir / "eval.jsonl")
        assert [e["policy_version"] for e in evals] == [0, MAX_STEPS]
        generator = (stack.run_dir / "metrics" / "generator-0.prom").read_text()
        assert gauge(generator, "asymptote_generator_policy_version") == MAX_STEPS
        assert gauge(generator, "asymptote_generator_swaps_total") >= 1
