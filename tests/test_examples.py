"""The example configs in examples/ load through the real config models, as the commands they document run them.

The Helm values files are rendered with the chart among tests/deploy's value
sets (chart_render.VALUE_SETS), where every chart test checks them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asymptote.config import load_config
from asymptote.tasks import DatasetSettings
from services.cli import up_config
from services.local.config import StackConfig

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
STACK_EXAMPLES = sorted(EXAMPLES.glob("*.yaml"))


def test_there_are_examples_for_the_stack_and_the_chart() -> None:
    assert {p.name for p in STACK_EXAMPLES} >= {"embedded-words.yaml", "qwen3-gsm8k.yaml"}
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


def test_the_words_workload_is_the_shipped_data_on_the_tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # it names its files from the repository root, as scripts/up.sh runs
    config = up_config(["--config", str(EXAMPLES / "embedded-words.yaml")])
    assert config.model_dir is None and config.model["family"] == "qwen3"
    assert isinstance(config.task, DatasetSettings)
    assert config.task.path.is_file() and config.task.eval_path is not None and config.task.eval_path.is_file()
    assert config.model["max_position_embeddings"] >= config.max_tokens + 96  # prompts are about 60 tokens


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
