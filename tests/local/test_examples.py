"""The example configs in examples/ load through the real config models, as the commands they document run them.

The Helm values files are rendered with the chart among tests/deploy's value
sets (chart_render.VALUE_SETS), where every chart test checks them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asymptote.config import load_config
from asymptote.tasks import DatasetSettings
from services.embedded.warmstart import tiny_model_settings
from services.local.config import StackConfig
from services.local.up import up_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
STACK_EXAMPLES = sorted(EXAMPLES.glob("*.yaml"))


def test_there_are_examples_for_the_stack_and_the_chart() -> None:
    assert {p.name for p in STACK_EXAMPLES} >= {"qwen3-gsm8k.yaml"}
    assert [p.name for p in (EXAMPLES / "helm").glob("*.yaml")] == ["qwen3-gsm8k-values.yaml"]


@pytest.mark.parametrize("path", STACK_EXAMPLES, ids=[p.stem for p in STACK_EXAMPLES])
def test_stack_examples_load_as_stack_configs(path: Path) -> None:
    config = load_config(StackConfig, path, "ASY_UP", environ={})
    assert isinstance(config.task, DatasetSettings)
    assert config.task.verifier.kind == "math"
    assert config.task.length_control.enabled
    high = (config.task.length_control.thinking_budget_tokens or (0, 0))[1]
    # The interrupted completion (budget, phrase, answer budget) fits in max_tokens with room for the phrase.
    assert high + config.task.length_control.answer_budget_tokens < config.max_tokens


def test_the_default_is_the_shipped_word_problems_on_a_tiny_qwen3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # its files are found from anywhere, not only the repository root
    config = up_config([])
    assert config.workload == "words" and config.model_dir is None
    assert isinstance(config.task, DatasetSettings) and config.task.template == "chat"
    assert config.task.path == REPO / "data" / "words" / "train.jsonl" and config.task.path.is_file()
    assert config.task.eval_path is not None and config.task.eval_path.is_file()
    assert config.task.verifier.kind == "math" and config.task.length_control.enabled
    high = (config.task.length_control.thinking_budget_tokens or (0, 0))[1]
    assert high + config.task.length_control.answer_budget_tokens < config.max_tokens
    spec, warmstart = tiny_model_settings(config.task, config.model, config.warmstart)
    assert spec.family == "qwen3" and spec.max_position_embeddings >= config.max_tokens + 96  # prompts: ~60 tokens
    assert warmstart.target_pass_rate < 0.5  # RL needs room above the warm start


def test_the_arithmetic_workload_fills_only_what_the_config_leaves(tmp_path: Path) -> None:
    quick = up_config(["--workload", "arithmetic"])
    assert quick.task.name == "arithmetic" and (quick.max_tokens, quick.batch_prompts) == (7, 32)
    assert up_config(["--workload", "arithmetic", "--max-tokens", "9"]).max_tokens == 9
    config = tmp_path / "quick.yaml"
    config.write_text("max_tokens: 12\nlr: 0.0003\n")
    given = up_config(["--config", str(config), "--workload", "arithmetic"])
    assert (given.task.name, given.max_tokens, given.lr, given.eval_num_samples) == ("arithmetic", 12, 3e-4, 4)
    config.write_text("workload: arithmetic\nbatch_prompts: 8\n")
    in_file = up_config(["--config", str(config)])
    assert (in_file.task.name, in_file.batch_prompts, in_file.max_tokens) == ("arithmetic", 8, 7)
    spec, _ = tiny_model_settings(quick.task, quick.model, quick.warmstart)
    assert spec.family == "llama"  # the character-level model the arithmetic task has always had


def test_a_workload_is_one_file_that_up_lists_and_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Adding a workload is adding a file to examples/workloads/: --workload lists it and reads it, its
    # relative paths against the checkout, whatever the working directory.
    from services.local import up, workloads

    folder = tmp_path / "workloads"
    shutil.copytree(workloads.WORKLOADS_DIR, folder)
    (folder / "words-short.yaml").write_text((folder / "words.yaml").read_text() + "max_steps: 40\nmax_tokens: 80\n")
    monkeypatch.setattr(workloads, "WORKLOADS_DIR", folder)
    monkeypatch.setattr(up, "WORKLOADS_DIR", folder)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        up_config(["--help"])
    assert "words-short" in capsys.readouterr().out
    mine = up_config(["--workload", "words-short"])
    assert (mine.workload, mine.max_steps, mine.max_tokens) == ("words-short", 40, 80)
    assert mine.task == up_config([]).task and isinstance(mine.task, DatasetSettings)
    assert mine.task.path == REPO / "data" / "words" / "train.jsonl"
    assert "max_steps" not in mine.model_fields_set  # the workload's, so a preset may still fill it
    with pytest.raises(SystemExit):
        up_config(["--workload", "nope"])
    assert "words-short" in capsys.readouterr().err


def test_a_users_dataset_does_not_inherit_the_word_problems_held_out_file(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(4)))
    config = up_config(["--model", str(model), "--dataset", str(train), "--holdout-fraction", "0.25"])
    assert isinstance(config.task, DatasetSettings)
    assert config.task.path == train and config.task.eval_path is None and config.task.holdout_fraction == 0.25


def test_the_gsm8k_example_runs_as_the_readme_says(tmp_path: Path) -> None:
    model = tmp_path / "Qwen3-0.6B"
    model.mkdir()
    (model / "config.json").write_text("{}")
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(4)]
    train, test = tmp_path / "gsm8k_train.jsonl", tmp_path / "gsm8k_test.jsonl"
    for path in (train, test):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--config", str(EXAMPLES / "qwen3-gsm8k.yaml"), "--model", str(model)]
    config = up_config([*argv, "--dataset", str(train), "--eval-dataset", str(test)])
    assert config.model_dir == model
    assert isinstance(config.task, DatasetSettings)
    assert (config.task.path, config.task.eval_path, config.task.preset) == (train, test, "gsm8k")
    assert config.task.system_prompt is not None and "\\boxed{}" in config.task.system_prompt
