"""The generator's task scorer: dataset prompts through their template, rewards through the pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from asymptote.contracts.v1 import rollout_pb2
from asymptote.tasks import ArithmeticSettings, DatasetSettings, task_digest
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
    from services.embedded.build import train_bpe_tokenizer, word_problem_corpus

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


def test_a_task_of_another_digest_is_refused_naming_both(tmp_path: Path) -> None:
    """A generator takes only its own task: another task's digest (another verifier, template or
    dataset), or none, is refused with both digests in the reason."""
    dataset = _settings(tmp_path, verifier=ExactSettings())
    scorer = TaskScorer(dataset, tmp_path, GeneratorMetrics())
    ours = task_digest(dataset)
    assert scorer.digest == ours
    scorer.check(rollout_pb2.GenerationTask(task_id="t", task_name="dataset", task_digest=ours))
    others = {
        "math verifier": task_digest(_settings(tmp_path)),
        "plain template": task_digest(_settings(tmp_path, verifier=ExactSettings(), template="plain")),
        "arithmetic": task_digest(ArithmeticSettings()),
    }
    assert len({ours, *others.values()}) == 4
    for theirs in others.values():
        task = rollout_pb2.GenerationTask(task_id="train-x", task_name="dataset", task_digest=theirs)
        with pytest.raises(ValueError, match=f"carries task digest {theirs}; this generator holds {ours}"):
            scorer.check(task)
    with pytest.raises(ValueError, match="carries task digest none"):
        scorer.check(rollout_pb2.GenerationTask(task_id="t", task_name="dataset"))
    # What only says how scoring runs leaves the digest alone.
    assert task_digest(_settings(tmp_path, verifier=ExactSettings(), num_score_workers=7, score_timeout_s=1.0)) == ours


def test_a_multiturn_task_s_length_control_is_its_dataset_s(tmp_path: Path) -> None:
    """The episodes' thinking budget comes from the multi-turn task's dataset, as a dataset task's does."""
    from asymptote.envs import EnvironmentSettings
    from asymptote.tasks.length import LengthControlSettings
    from asymptote.tasks.multiturn import MultiTurnSettings
    from services.embedded.build import train_bpe_tokenizer, word_problem_corpus

    train_bpe_tokenizer(word_problem_corpus(200), 512).save_pretrained(tmp_path / "model")
    length = LengthControlSettings(thinking_budget_tokens=(8, 16), interruption_phrase="Time is up.")

    def scorer(**dataset: object) -> TaskScorer:
        task = MultiTurnSettings(
            dataset=_settings(tmp_path, verifier=ExactSettings(), **dataset),
            environment=EnvironmentSettings(entry="asymptote.envs.calculator:Calculator", kind="tools"),
        )
        return TaskScorer(task, tmp_path / "model", GeneratorMetrics())

    control = scorer(length_control=length).length_control("multiturn")
    assert control is not None and control.settings == length
    assert control.phrase_ids == scorer().tokenizer().encode("Time is up.", add_special_tokens=False)
    assert scorer().length_control("multiturn") is None  # off in the dataset: none
    assert scorer(length_control=length).length_control("dataset") is None  # another task's name
