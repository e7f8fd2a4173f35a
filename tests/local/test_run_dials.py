"""Stack dials: ``asymptote up --seed``, one for the run's randomness, carried to the broker (prompt order), the
learner (torch) and each generator (sampling, one seed apiece); the eval round's size, carried to the broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from asymptote.config import load_config
from asymptote.errors import ConfigError
from services.broker.config import BrokerConfig
from services.generator.config import GeneratorConfig
from services.learner.config import LearnerConfig
from services.local.stack import LocalStack
from services.local.up import up_config


def _seeds(tmp_path: Path, *flags: str) -> tuple[int, int, list[int]]:
    config = up_config([*flags, "--generators", "2", "--run-dir", str(tmp_path / "run")])
    paths = LocalStack(config).write_configs(tmp_path / "model")
    broker = load_config(BrokerConfig, paths["broker"], "ASY_BROKER", environ={})
    learner = load_config(LearnerConfig, paths["learner"], "ASY_LEARNER", environ={})
    gens = [load_config(GeneratorConfig, paths[f"generator-{i}"], "ASY_GENERATOR", environ={}) for i in range(2)]
    return broker.seed, learner.seed, [g.engine.seed for g in gens]


def test_the_seed_reaches_every_service_and_each_generator_gets_its_own(tmp_path: Path) -> None:
    assert _seeds(tmp_path / "default") == (0, 0, [0, 1])
    assert _seeds(tmp_path / "seeded", "--seed", "7") == (7, 7, [7, 8])


def test_a_services_own_seed_is_refused_for_the_dial(tmp_path: Path) -> None:
    config = tmp_path / "up.yaml"
    config.write_text("services: {broker: {seed: 3}}\n")
    with pytest.raises(ConfigError) as caught:
        up_config(["--config", str(config)])
    assert "broker.seed" in str(caught.value) and "seed" in str(caught.value)


def test_a_negative_seed_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError) as caught:
        up_config(["--seed", "-1"])
    assert str(caught.value).startswith("--seed") and "\n" not in str(caught.value)


def test_the_eval_round_size_is_a_stack_dial(tmp_path: Path) -> None:
    config = tmp_path / "up.yaml"
    config.write_text("eval_num_prompts: 150\neval_num_samples: 4\neval_every_versions: 40\n")
    stack = LocalStack(up_config(["--config", str(config), "--run-dir", str(tmp_path / "run")]))
    broker = load_config(BrokerConfig, stack.write_configs(tmp_path / "model")["broker"], "ASY_BROKER", environ={})
    assert (broker.eval.num_prompts, broker.eval.num_samples, broker.eval.every_versions) == (150, 4, 40)
    assert broker.eval_num_prompts(heldout=200) == 150 and broker.eval_num_prompts(heldout=100) == 100
    config.write_text("services: {broker: {eval: {num_prompts: 150}}}\n")
    with pytest.raises(ConfigError, match=r"broker\.eval\.num_prompts is the stack's eval_num_prompts"):
        up_config(["--config", str(config)])
