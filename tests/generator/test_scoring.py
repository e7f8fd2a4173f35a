"""The generator's task scorer: dataset prompts through their template, rewards through the pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from asymptote.tasks import ArithmeticSettings, DatasetSettings
from asymptote.tasks.verifiers import ExactSettings
from services.generator.metrics import GeneratorMetrics
from services.generator.scoring import TaskScorer


def _settings(tmp_path: Path, **kw: object) -> DatasetSettings:
    # The generator never reads the files: the path need not exist.
    return DatasetSettings(path=tmp_path / "absent.jsonl", holdout_fraction=0.1, **kw)  # type: ignore[arg-type]


async def test_dataset_rewards_go_through_the_pool_and_are_counted(tmp_path: Path) -> None:
    metrics = GeneratorMetrics()
    scorer = TaskScorer(_settings(tmp_path, reward_style="signed", score_timeout_s=3.0), tmp_path, metrics)
    try:
        texts = ["\\boxed{9^{9^{9^{9^{9}}}}}", "so \\boxed{72}", "\\boxed{71}", "72"]
        assert await scorer.rewards("dataset", texts, "72") == [-1.0, 1.0, -1.0, -1.0]
        counted = {r: metrics.verdicts.labels(r)._value.get() for r in ("timeout", "correct", "wrong", "no_answer")}
        assert counted == {"timeout": 1.0, "correct": 1.0, "wrong": 1.0, "no_answer": 1.0}
        # The arithmetic task is still scored in this process.
        assert await scorer.rewards("arithmetic", ["225", "224"], "225") == [1.0, 0.0]
    finally:
        scorer.close()


def test_plain_and_chat_templates(tmp_path: Path) -> None:
    from services.learner.build import train_bpe_tokenizer, word_problem_corpus

    plain = TaskScorer(
        _settings(tmp_path, template="plain", system_prompt="Be brief.", prompt_format="Q: {prompt}\nA:"),
        tmp_path,
        GeneratorMetrics(),
    )
    assert plain.prompt("dataset", "1+1?") == "Be brief.\n\nQ: 1+1?\nA:"
    train_bpe_tokenizer(word_problem_corpus(200), 512).save_pretrained(tmp_path / "model")
    chat = TaskScorer(
        _settings(tmp_path, system_prompt="Box the answer.", verifier=ExactSettings()),
        tmp_path / "model",
        GeneratorMetrics(),
    )
    assert chat.prompt("dataset", "1+1?") == (
        "<|im_start|>system\nBox the answer.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    )
    # Arithmetic prompts are sent as they are.
    assert chat.prompt("arithmetic", "037+485=") == "037+485="


def test_unknown_tasks_and_unconfigured_datasets_are_refused(tmp_path: Path) -> None:
    scorer = TaskScorer(ArithmeticSettings(), tmp_path, GeneratorMetrics())
    scorer.check("arithmetic")
    with pytest.raises(ValueError, match="unknown task 'sudoku'"):
        scorer.check("sudoku")
    with pytest.raises(ValueError, match="task 'dataset' has no default settings"):
        scorer.check("dataset")
