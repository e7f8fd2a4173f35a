"""``asymptote up --lora-rank``: one place for the adapter's settings, carried to the learner, and the LoRA
learning rate of "LoRA Without Regret" where none is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from asymptote.config import load_config
from asymptote.errors import ConfigError
from asymptote.lora import LORA_LR_FACTOR, LoraSettings
from services.local.up import up_config


def test_lora_rank_sets_the_adapter_and_ten_times_the_learning_rate() -> None:
    plain = up_config([])
    adapted = up_config(["--lora-rank", "8"])
    assert plain.lora is None
    assert adapted.lora == LoraSettings(rank=8)
    assert adapted.lr == pytest.approx(LORA_LR_FACTOR * plain.lr) == pytest.approx(1e-3)
    # A learning rate given is the user's own.
    assert up_config(["--lora-rank", "8", "--lr", "1e-3"]).lr == 1e-3


def test_lora_rank_goes_over_a_configs_lora(tmp_path: Path) -> None:
    config = tmp_path / "up.yaml"
    config.write_text("lora: {rank: 4, alpha: 16, target_modules: [q_proj, v_proj]}\n")
    assert up_config(["--config", str(config), "--lora-rank", "2"]).lora == LoraSettings(
        rank=2, alpha=16, target_modules=("q_proj", "v_proj")
    )


@pytest.mark.parametrize("rank", ["0", "-1"])
def test_a_rank_below_one_is_refused_naming_the_flag(rank: str) -> None:
    with pytest.raises(ConfigError) as caught:
        up_config(["--lora-rank", rank])
    assert str(caught.value).startswith("--lora-rank") and "greater than or equal to 1" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_lora_run_gives_the_learner_and_every_generator_the_same_adapter(tmp_path: Path) -> None:
    from services.generator.config import GeneratorConfig
    from services.learner.config import LearnerConfig
    from services.local.stack import LocalStack

    config = up_config(["--lora-rank", "8", "--generators", "2", "--run-dir", str(tmp_path / "run")])
    paths = LocalStack(config).write_configs(tmp_path / "model")
    learner = load_config(LearnerConfig, paths["learner"], "ASY_LEARNER", environ={})
    generators = [load_config(GeneratorConfig, paths[f"generator-{i}"], "ASY_GENERATOR", environ={}) for i in range(2)]
    assert learner.lora == LoraSettings(rank=8)
    assert [g.lora for g in generators] == [learner.lora] * 2
