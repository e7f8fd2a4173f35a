"""Every recipe knob reaches its service through StackConfig, and the caller's environment cannot change one.

A ``services`` section of the stack config is merged over what the stack
derives for each service, and what the service reads back from its
recorded config under ``config/`` is what was set; the stack's wiring is
refused by name. An ``ASY_<SERVICE>__...`` variable in the caller's
environment (which the service would read over its file) is never passed
on, so the recorded configs are the run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from asymptote.config import load_config
from services.broker.config import BrokerConfig
from services.fitter.config import FitterConfig
from services.generator.config import GeneratorConfig
from services.learner.config import LearnerConfig
from services.local.config import StackConfig
from services.local.stack import LocalStack
from tests.helpers.families import QWEN3_8B, config_only

RECIPE: dict[str, dict[str, Any]] = {
    "learner": {
        "loss": {"name": "dapo", "clip_low": 0.25, "clip_high": 0.3, "tis_cap": 3.0, "aggregation": "token",
                 "normalization": "group"},
        "optimizer": {"weight_decay": 0.05, "betas": [0.9, 0.95], "eps": 1e-15, "max_grad_norm": 0.5},
        "micro_batch_tokens": 2048,
        "activation_checkpointing": True,
        "keep_checkpoints": 3,
    },
    "broker": {"sampling": {"temperature": 0.8, "top_p": 0.95}},
    "generator": {"engine": {"max_model_len": 1024, "max_num_seqs": 64}, "max_inflight_groups": 8},
    "fitter": {"planned_compute": 123456.0},
}  # fmt: skip
"""A setting of every kind the recipe has: the loss and its clips, AdamW, memory dials, sampling,
staleness, the engine, the fitter's planned budget."""


def model_dir(tmp_path: Path) -> Path:
    return config_only(tmp_path / "model", QWEN3_8B)


def read_back(path: Path, model: type[Any]) -> dict[str, Any]:
    loaded = load_config(model, path, "ASY_NONE", environ={})
    dumped: dict[str, Any] = loaded.model_dump(mode="json")
    return dumped


def contains(whole: dict[str, Any], part: dict[str, Any]) -> bool:
    return all(contains(whole[k], v) if isinstance(v, dict) else whole.get(k) == v for k, v in part.items())


def test_every_recipe_knob_reaches_its_service_s_recorded_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASY_LEARNER__OPTIMIZER__LR", "0.5")  # the caller's: must change nothing
    monkeypatch.setenv("ASY_GENERATOR__ENGINE__SEED", "99")
    stack = LocalStack(
        StackConfig(
            run_dir=tmp_path / "run", num_generators=2, lr=3e-6, max_staleness_versions=4, seed=7, services=RECIPE
        )
    )
    paths = stack.write_configs(model_dir(tmp_path))
    models = {"broker": BrokerConfig, "learner": LearnerConfig, "fitter": FitterConfig}
    for name, model in models.items():
        assert contains(read_back(paths[name], model), RECIPE[name]), name
    for i in range(2):
        generator = read_back(paths[f"generator-{i}"], GeneratorConfig)
        assert contains(generator, RECIPE["generator"])
        assert generator["eval_hold_versions"] == 2  # half the broker's staleness bound of 4 (at most 4)
        assert generator["engine"]["seed"] == 7 + i  # the run's seed, one apiece
    # What each service starts with: its recorded file, and of overrides only the run's NATS credentials.
    for name in paths:
        role = name.split("-")[0].upper()
        overrides = {k for k in stack.process_env(name) if k.startswith(("ASY_LEARNER__", "ASY_GENERATOR__"))}
        assert overrides <= {f"ASY_{role}__NATS__USER", f"ASY_{role}__NATS__PASSWORD"}, name
    assert (
        load_config(LearnerConfig, paths["learner"], "ASY_LEARNER", stack.process_env("learner")).optimizer.lr == 3e-6
    )


def test_the_stack_s_wiring_and_bad_values_are_refused_by_name() -> None:
    for section, said in (
        ({"learner": {"grpc": {"port": 1}}}, "learner.grpc is set by the stack"),
        ({"generator": {"engine": {"model_dir": "/x"}}}, "generator.engine.model_dir is set by the stack"),
        ({"broker": {"task": {"name": "arithmetic"}}}, "broker.task is set by the stack"),
        ({"fitter": {"prefix": "other"}}, "fitter.prefix is set by the stack"),
        ({"generator": {"sandbox_pool": {"endpoint": "h:1"}}}, "generator.sandbox_pool is set by the stack"),
        ({"learner": {"optimizer": {"eps": -1}}}, "learner.optimizer.eps: Input should be greater than 0"),
        ({"fitter": {"no_such_knob": 1}}, "fitter.no_such_knob: Extra inputs are not permitted"),
        # One place for each setting: the stack's own dial, not the service's field it sets.
        ({"learner": {"optimizer": {"lr": 1e-6}}}, r"learner.optimizer.lr is the stack's lr: set lr itself"),
        ({"broker": {"sampling": {"max_tokens": 64}}}, r"broker.sampling.max_tokens is the stack's max_tokens"),
        ({"learner": {"batch_prompts": 4}}, r"learner.batch_prompts is the stack's batch_prompts"),
        ({"generator": {"engine": {"seed": 7}}}, r"generator.engine.seed is the stack's seed"),
    ):
        with pytest.raises(ValidationError, match=said):
            StackConfig(services=section)  # type: ignore[arg-type]
