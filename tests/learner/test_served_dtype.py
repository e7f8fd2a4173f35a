"""Versions are served in the model directory's dtypes, from float32 master weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from asymptote.codec import DecodedWeights, read_signature
from asymptote.errors import WeightsError
from asymptote.tasks import ALPHABET
from services.embedded.build import ModelSpec, create_model_dir
from services.generator.weights import check_signature
from services.learner.model import load_model
from services.learner.weights import WeightStore, to_wire

SPEC = ModelSpec(hidden_size=32, num_heads=1, num_layers=1, intermediate_size=64, max_position_embeddings=32)


@pytest.fixture
def bf16_dir(tmp_path: Path) -> Path:
    """A model directory whose checkpoint is bfloat16, as most published models are."""
    out = create_model_dir(SPEC, ALPHABET, tmp_path / "m")
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(out / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_bf16_model_trains_in_float32_and_is_served_in_bf16(bf16_dir: Path) -> None:
    model = load_model(bf16_dir)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # master weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.randn_like(p))  # a step's worth of change, below bf16's resolution in places
    signature = read_signature(bf16_dir)
    version = WeightStore(signature).snapshot(1, model)
    state = model.state_dict()
    for name, wire in version.tensors.items():
        assert wire.dtype == "bfloat16", name
        want = state[name].detach().to(torch.bfloat16).view(torch.int16).numpy()
        assert np.array_equal(wire.to_numpy().view(np.int16), want), name  # round-to-nearest of the master
    # The generator takes it: names, dtypes and shapes are the checkpoint's.
    check_signature(DecodedWeights(1, version.digest, version.tensors), signature)


def test_the_generator_still_refuses_a_float32_update_of_a_bf16_model(bf16_dir: Path) -> None:
    model = load_model(bf16_dir)
    signature = read_signature(bf16_dir)
    tensors = {name: to_wire(model.state_dict()[name]) for name in signature}  # not converted: float32
    with pytest.raises(WeightsError, match=r"is float32\[.*\], the model needs bfloat16"):
        check_signature(DecodedWeights(1, "x", tensors), signature)


def test_an_unservable_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="cannot serve weights as int8"):
        to_wire(torch.zeros(2), "int8")
