"""A generator of a mixture: each task judged by its own sub-task's verifier, prompt template and length
control; a task of no sub-task, or of another task, refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asymptote.contracts.v1 import rollout_pb2
from asymptote.tasks import MixtureSettings, task_digest
from services.generator.metrics import GeneratorMetrics
from services.generator.mixing import MixtureScorer, make_scorer
from services.generator.scoring import TaskScorer
from services.local.workloads import workload_task


async def test_each_task_is_scored_by_its_sub_tasks_verifier(tmp_path: Path) -> None:
    from services.embedded.build import train_bpe_tokenizer, word_problem_corpus

    model = tmp_path / "model"
    train_bpe_tokenizer(word_problem_corpus(200), 512).save_pretrained(model)
    settings = workload_task("words+code")
    assert settings.names == ("words", "code")
    metrics = GeneratorMetrics()
    scorer = make_scorer(settings, model, metrics)
    assert isinstance(scorer, MixtureScorer) and isinstance(
        make_scorer(workload_task("words"), model, metrics), TaskScorer
    )
    code_reference = json.dumps({"kind": "stdio", "cases": [{"input": "", "output": "19\n"}]})
    program, boxed = "<think>\n</think>\n\n```python\nprint(8 + 11)\n```", "<think>\n</think>\n\n\\boxed{19}"
    try:
        # The same answer in the two formats: each sub-task pays only for its own.
        assert await scorer.rewards("words", [boxed, program, "\\boxed{18}"], "19") == [1.0, 0.0, 0.0]
        assert await scorer.rewards("code", [program, boxed, program.replace("11", "12")], code_reference) == [
            1.0,
            0.0,
            0.0,
        ]
        # Each prompt through its sub-task's prompt format; length control only where the sub-task has it.
        assert scorer.prompt("code", "Ada has 3 apples.").endswith(
            "Ada has 3 apples. Answer with a Python program that prints the number.<|im_end|>\n<|im_start|>assistant\n"
        )
        assert scorer.prompt("words", "Ada has 3 apples.").endswith(
            "Ada has 3 apples.<|im_end|>\n<|im_start|>assistant\n"
        )
        assert scorer.length_control("words") is not None and scorer.length_control("code") is None
    finally:
        scorer.close()


def test_tasks_of_no_sub_task_or_another_task_are_refused(tmp_path: Path) -> None:
    settings = workload_task("words+code")
    scorer = MixtureScorer(settings, tmp_path, GeneratorMetrics())
    ours = rollout_pb2.GenerationTask(task_id="t-1", task_name="code", task_digest=task_digest(settings))
    scorer.check(ours)
    ours.task_name = "poetry"
    with pytest.raises(ValueError, match="names sub-task 'poetry'; this mixture has words, code"):
        scorer.check(ours)
    reweighted = settings.model_dump()
    reweighted["tasks"][0]["weight"] = 3.0
    theirs = rollout_pb2.GenerationTask(
        task_id="t-2", task_name="code", task_digest=task_digest(MixtureSettings.model_validate(reweighted))
    )
    with pytest.raises(ValueError, match="carries task digest"):
        scorer.check(theirs)
