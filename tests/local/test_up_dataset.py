"""``asymptote up --model DIR --dataset FILE``: the stack config the flags make (no stack is started).

The refusals (a missing file, no held-out split, no --model, fields not in the
file) are in test_cli_errors.py, run as a user runs them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asymptote.tasks import DatasetTask
from asymptote.tasks.verifiers import ExactSettings
from services.local.up import up_config


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")  # up checks for it; the model itself is checked when the stack starts
    return d


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GSM8K_ROWS = [
    {"question": f"Ada has {i} apples and buys 2 more. How many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2:,}"}
    for i in range(998, 1018)
]


def test_a_gsm8k_layout_is_read_with_its_preset(model_dir: Path, tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    config = up_config(["--model", str(model_dir), "--dataset", str(train), "--holdout-fraction", "0.1"])
    task = config.task
    assert task.name == "dataset" and task.preset == "gsm8k"
    assert (task.path, task.holdout_fraction, task.eval_path) == (train.resolve(), 0.1, None)
    assert config.model_dir == model_dir
    tasks = DatasetTask(task)
    train_problems, heldout = tasks.problems("train"), tasks.problems("heldout")
    assert (len(train_problems), len(heldout)) == (18, 2)
    # The number after '####', commas dropped.
    assert sorted(int(p.reference) for p in [*train_problems, *heldout]) == list(range(1000, 1020))


def test_default_fields_and_a_held_out_file(model_dir: Path, tmp_path: Path) -> None:
    train = _jsonl(
        tmp_path / "train.jsonl", [{"id": f"r{i}", "prompt": f"{i}+1?", "answer": str(i + 1)} for i in range(6)]
    )
    heldout = _jsonl(tmp_path / "test.jsonl", [{"id": "t0", "prompt": "9+1?", "answer": "10"}])
    config = up_config(
        ["--model", str(model_dir), "--dataset", str(train), "--eval-dataset", str(heldout), "--max-tokens", "256"]
    )
    task = config.task
    assert task.name == "dataset" and task.preset == "none" and task.eval_path == heldout.resolve()
    assert config.max_tokens == 256
    tasks = DatasetTask(task)
    assert [p.prompt_id for p in tasks.problems("train")] == [f"r{i}" for i in range(6)]
    assert [(p.prompt_id, p.reference) for p in tasks.problems("heldout")] == [("t0", "10")]


def test_flags_keep_the_config_files_mapping_and_verifier(model_dir: Path, tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "mine.jsonl", [{"q": f"{i}?", "a": str(i)} for i in range(4)])
    config_file = tmp_path / "up.yaml"
    config_file.write_text(
        "task:\n  name: dataset\n  path: elsewhere.jsonl\n  eval_path: elsewhere-test.jsonl\n"
        "  fields: {prompt: q, answer: a, id: null}\n  verifier: {kind: exact}\n"
    )
    config = up_config(
        ["--config", str(config_file), "--model", str(model_dir), "--dataset", str(train), "--holdout-fraction", "0.25"]
    )
    task = config.task
    assert task.name == "dataset" and task.path == train.resolve()
    assert (task.eval_path, task.holdout_fraction) == (None, 0.25)  # the flag's split replaces the file's
    assert task.field_names.prompt == "q" and task.verifier == ExactSettings()
    assert len(DatasetTask(task).problems("train")) == 3
