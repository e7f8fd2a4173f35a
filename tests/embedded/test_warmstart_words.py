"""The warm start on a dataset task: a BPE tokenizer trained on the rows, and the think-then-box format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asymptote.tasks import ArithmeticSettings, DatasetSettings, DatasetTask, get_task, words
from asymptote.tasks.length import LengthControlSettings
from asymptote.tasks.readers import DatasetError
from services.embedded.build import ModelSpec, build_model
from services.embedded.warmstart import (
    ARITHMETIC_FORMAT,
    BPE_VOCAB_SIZE,
    WarmstartSettings,
    cache_key,
    encode_prompts,
    encode_targets,
    format_for,
    interrupted,
    supervised_pass,
    tokenizer_for,
)

SPEC = ModelSpec(family="qwen3", num_kv_heads=2, head_dim=64, max_position_embeddings=256)


def subset(tmp_path: Path, num_train: int = 48, num_heldout: int = 8, drop_solution: bool = False) -> DatasetSettings:
    rows = words.generate(num_train, num_heldout, seed=7)
    paths = {}
    for split, split_rows in rows.items():
        if drop_solution:
            split_rows = [{k: v for k, v in r.items() if k != "solution"} for r in split_rows]
        paths[split] = tmp_path / f"{split}.jsonl"
        paths[split].write_text(words.render(split_rows))
    return DatasetSettings(path=paths["train"], eval_path=paths["heldout"])


def test_the_format_thinks_the_worked_solution_then_boxes_the_answer(tmp_path: Path) -> None:
    settings = subset(tmp_path)
    task = DatasetTask(settings)
    tokenizer = tokenizer_for(task, SPEC)
    assert len(tokenizer) == BPE_VOCAB_SIZE
    fmt = format_for(task, tokenizer)
    first = task.problems("train")[0]
    row = json.loads(settings.path.read_text().splitlines()[0])
    assert fmt.target(first) == f"<think>\n{row['solution']}\n</think>\n\n\\boxed{{{row['answer']}}}"
    assert task.score(fmt.target(first), first.reference) == 1.0
    # The prompt is the chat template's user turn, then the assistant's turn opened for the model.
    assert fmt.prompt(first) == f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    (prompt,) = encode_prompts(tokenizer, [first], fmt)
    (target,) = encode_targets(tokenizer, [first], fmt)
    assert tokenizer.decode(prompt) == fmt.prompt(first)  # no BOS added: the template is the whole prompt
    assert target[-1] == tokenizer.eos_token_id and tokenizer.decode(target[:-1]) == fmt.target(first)
    assert target[0] == tokenizer.convert_tokens_to_ids("<think>")
    # Length control appends the interruption phrase: trained into the vocabulary, it stays short.
    phrase = tokenizer.encode(settings.length_control.interruption_phrase, add_special_tokens=False)
    assert len(phrase) <= 20, len(phrase)  # 82 bytes


def test_the_arithmetic_task_keeps_its_bare_format() -> None:
    task = get_task("arithmetic", ArithmeticSettings())
    assert format_for(task, tokenizer_for(task, ModelSpec())) is ARITHMETIC_FORMAT


def test_a_dataset_without_worked_solutions_is_refused(tmp_path: Path) -> None:
    task = DatasetTask(subset(tmp_path, drop_solution=True))
    with pytest.raises(DatasetError, match="'solution'"):
        tokenizer_for(task, SPEC)


def test_the_cache_key_follows_the_files_content_not_their_place(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    here, there = subset(tmp_path / "a"), subset(tmp_path / "b")
    assert cache_key(SPEC, here, WarmstartSettings()) == cache_key(SPEC, there, WarmstartSettings())
    with there.path.open("a") as f:
        f.write(words.render(words.generate(1, 0, seed=99)["train"]).replace('"w00000"', '"extra"'))
    assert cache_key(SPEC, here, WarmstartSettings()) != cache_key(SPEC, there, WarmstartSettings())


def test_supervised_pass_learns_the_format(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    task = DatasetTask(subset(tmp_path))
    tokenizer = tokenizer_for(task, SPEC)
    model = build_model(SPEC, tokenizer)
    settings = WarmstartSettings(max_steps=40, check_every_steps=1000, batch_size=16, lr=2e-3, warmup_steps=5)
    report = supervised_pass(model, tokenizer, task, settings, log_every=0)
    assert report.num_steps == 40
    # From a uniform guess over the vocabulary (ln 512 = 6.2) to well under half of it.
    assert report.losses[0] > 5.5 and sum(report.losses[-5:]) / 5 < 2.5, (report.losses[0], report.losses[-5:])


def test_with_length_control_a_share_of_targets_answers_after_the_phrase(tmp_path: Path) -> None:
    plain = subset(tmp_path)
    settings = plain.model_copy(
        update={"length_control": LengthControlSettings(thinking_budget_tokens=(8, 40), answer_budget_tokens=16)}
    )
    task = DatasetTask(settings)
    tokenizer = tokenizer_for(task, SPEC)
    fmt, full = format_for(task, tokenizer), format_for(DatasetTask(plain), tokenizer)
    phrase = settings.length_control.interruption_phrase
    problems = task.problems("train")
    cut = [p for p in problems if phrase in fmt.target(p)]
    assert [p.prompt_id for p in cut] == [p.prompt_id for p in problems if interrupted(p.prompt_id)]
    assert 0.1 * len(problems) <= len(cut) <= 0.45 * len(problems)
    for p in problems:
        target = fmt.target(p)
        assert task.score(target, p.reference) == 1.0
        if p in cut:
            thinking, answer = target.split(phrase)
            assert full.target(p).startswith(thinking) and "</think>" not in thinking
            assert answer == f"\n\n\\boxed{{{p.reference}}}"
        else:
            assert target == full.target(p)
