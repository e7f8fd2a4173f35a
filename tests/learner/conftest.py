"""Fixtures of the learner's mixture-of-experts tests: one tiny Qwen3-MoE directory and its loaded model."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedModel

from services.embedded.build import create_test_model_dir
from services.learner.model import load_model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE from the model builder: 3 layers, the first dense, 8 experts, top-2, float32."""
    return create_test_model_dir("qwen3_moe", True, tmp_path_factory.mktemp("moe") / "m", num_layers=3)


@pytest.fixture(scope="module")
def moe_loaded(moe_dir: Path) -> PreTrainedModel:
    """``moe_dir`` loaded as the learner loads it (not to be changed: copy it)."""
    return load_model(moe_dir)
