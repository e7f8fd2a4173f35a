"""`asymptote up --model`: a real model trains with its size's preset, never the tiny model's settings.

The preset fills only what neither ``--config`` nor a flag sets, is printed
at start, and a learning rate 10x the preset's warns for any model of 100M
parameters or more. Model directories here hold random weights of the
stated size (no download), read by their safetensors headers alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.local.presets import PRESETS, preset_for
from services.local.up import up_config


def model_of(tmp_path: Path, parameters: int) -> Path:
    """A model directory whose stored tensors hold ``parameters`` values (bf16 zeros: the headers count)."""
    out = tmp_path / f"m{parameters}"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    save_file({"w": torch.zeros(parameters // 1000, 1000, dtype=torch.bfloat16)}, str(out / "model.safetensors"))
    return out


def test_the_preset_follows_the_size() -> None:
    assert [preset_for(n).name for n in (50_000_000, 600_000_000, 8_000_000_000)] == ["tiny", "small", "paper-8b"]
    paper = PRESETS[-1]
    assert paper.settings == {
        "lr": 5e-7,
        "warmup_steps": 100,
        "batch_prompts": 48,
        "group_size": 16,
        "max_tokens": 8192,
    }
    assert paper.thinking_budget() == (4096, 7680)


def test_a_real_model_takes_its_preset_unless_told_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_of(tmp_path, 600_000_000)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(20)))
    config = up_config(["--model", str(model), "--dataset", str(data), "--holdout-fraction", "0.1"])
    assert (config.lr, config.warmup_steps, config.batch_prompts, config.group_size, config.max_tokens) == (
        1e-6,
        50,
        32,
        8,
        4096,
    )
    assert config.task.length_control.thinking_budget_tokens == (2048, 3584)  # type: ignore[union-attr]
    out = capsys.readouterr()
    assert "preset small (600M parameters): lr 1e-06, warm-up 50, batch 32 x 8, max_tokens 4096" in out.out
    assert "warning" not in out.err
    # Flags win over the preset, field by field; a tiny model's rate on this model warns.
    config = up_config(["--model", str(model), "--lr", "2e-4", "--max-tokens", "1024", "--group-size", "4"])
    assert (config.lr, config.max_tokens, config.group_size, config.batch_prompts) == (2e-4, 1024, 4, 32)
    err = capsys.readouterr().err
    assert "warning: lr 0.0002 is 200x the small preset's 1e-06 for a model of 600M parameters" in err


def test_a_config_file_wins_over_the_preset_too(tmp_path: Path) -> None:
    model = model_of(tmp_path, 2_000_000_000)
    config_file = tmp_path / "up.yaml"
    config_file.write_text("warmup_steps: 7\nbatch_prompts: 12\n")
    config = up_config(["--config", str(config_file), "--model", str(model)])
    assert (config.lr, config.warmup_steps, config.batch_prompts, config.max_tokens) == (5e-7, 7, 12, 8192)


def test_a_tiny_model_keeps_the_stack_s_settings(tmp_path: Path) -> None:
    config = up_config(["--model", str(model_of(tmp_path, 5_000_000))])
    assert (config.lr, config.max_tokens, config.batch_prompts) == (1e-4, 96, 16)
