"""A mixture of experts' weights as the learner serves them: the model directory's layout, one tensor per expert.

transformers 5 trains each MoE layer's experts as fused 3-D parameters but
stores them one tensor per expert, as the released checkpoints are, and
the generator's vLLM loads that layout. The learner serves every version
in it: after loading, the served tensors are the model directory's, bit
for bit; after a step they are what ``save_pretrained`` writes of the
trained model, and a delta between two versions rebuilds the second.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from asymptote.codec import DecodedWeights, read_signature
from asymptote.delta import apply_delta
from services.generator.weights import check_signature
from services.learner.config import LossSettings, MoeSettings, OptimizerSettings
from services.learner.model import empty_model
from services.learner.trainer import Trainer, collate
from services.learner.weights import Version, WeightStore, served_signature, split_stored, stored_layout

sys.path.insert(0, str(Path(__file__).parent))
from ddp_worker import batch


def trainer_of(where: Path, lr: float = 1e-2) -> Trainer:
    trainer = Trainer(
        empty_model(where), LossSettings(), OptimizerSettings(lr=lr), moe=MoeSettings(routing_replay=False)
    )
    trainer.start(where)
    return trainer


def served(trainer: Trainer, store: WeightStore, version: int) -> Version:
    return store.snapshot_tensors(version, trainer.served_tensors(store.names))


def assert_served_equal(version: Version, stored: dict[str, torch.Tensor]) -> None:
    """Every served tensor is the stored tensor of its name: same names, dtype, shape and bits."""
    assert sorted(version.tensors) == sorted(stored)
    for name, wire in version.tensors.items():
        want = stored[name]
        assert (wire.dtype, wire.shape) == (str(want.dtype).removeprefix("torch."), tuple(want.shape)), name
        assert np.array_equal(wire.to_numpy(), want.numpy()), name


def test_served_tensors_are_the_model_directory_s_one_per_expert(moe_dir: Path) -> None:
    trainer = trainer_of(moe_dir)
    signature = read_signature(moe_dir)
    stored = load_file(str(moe_dir / "model.safetensors"))
    experts = [n for n in stored if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3  # two MoE layers, 8 experts, gate, up and down each
    assert served_signature(trainer.model, "float32") == signature
    layout = stored_layout(trainer.model)
    assert layout["model.layers.1.mlp.experts.5.up_proj.weight"] == "model.layers.1.mlp.experts.gate_up_proj"
    assert layout["model.layers.2.mlp.experts.7.down_proj.weight"] == "model.layers.2.mlp.experts.down_proj"
    store = WeightStore(signature)
    version = served(trainer, store, 1)
    assert_served_equal(version, stored)
    check_signature(DecodedWeights(1, version.digest, version.tensors), signature)  # what the generator takes
    # The plain (unsharded, no trainer) path serves the same bytes.
    assert WeightStore(signature).snapshot(1, trainer.model).digest == version.digest


def test_after_a_step_the_served_experts_are_what_save_pretrained_writes(moe_dir: Path, tmp_path: Path) -> None:
    trainer = trainer_of(moe_dir, lr=1e-5)
    signature = read_signature(moe_dir)
    store = WeightStore(signature)
    # Served in bf16 as well, where a small step leaves most elements as they were: a delta is worth sending.
    half = WeightStore({name: ("bfloat16", shape) for name, (_, shape) in signature.items()})
    before, half_before = served(trainer, store, 1), served(trainer, half, 1)
    trainer.step(collate(batch(random.Random(5), 0, 4), pad_id=0), learner_version=1)
    after, half_after = served(trainer, store, 2), served(trainer, half, 2)
    trainer.model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert_served_equal(after, saved)
    moved = {n for n in signature if not np.array_equal(saved[n].numpy(), before.tensors[n].to_numpy())}
    # The experts the step routed tokens to got a gradient and moved; each expert's part of the fused gradient
    # says which, in the stored layout.
    trained = set()
    for key, param in trainer.model.named_parameters():
        if param.grad is not None:
            trained |= {n for n, g in split_stored(trainer.model, key, param.grad).items() if g.abs().sum() > 0}
    assert moved == trained
    assert 30 < len([n for n in moved if ".experts." in n]) < 48  # most experts, not all: some got no token
    # A delta of version 2 on version 1 rebuilds version 2 in the stored layout, experts included.
    frames = half.delta(2, 1, half_before.digest)
    assert frames is not None and sum(map(len, frames)) < half_after.num_bytes
    base = np.concatenate([np.frombuffer(half_before.tensors[n].data, np.uint8) for n in sorted(signature)])
    rebuilt = apply_delta(frames, half.signature, base, half_before.digest)
    assert rebuilt.digest == half_after.digest
    for name, wire in rebuilt.tensors.items():
        want = saved[name].to(torch.bfloat16).view(torch.int16).numpy()
        assert np.array_equal(wire.to_numpy().view(np.int16), want), name


def test_an_expert_the_model_lacks_is_refused_and_a_fused_name_comes_whole(moe_dir: Path) -> None:
    trainer = trainer_of(moe_dir)
    with pytest.raises(KeyError, match=r"no parameters named \['model.layers.1.mlp.experts.8.up_proj.weight'\]"):
        trainer.served_tensors(["model.layers.1.mlp.experts.8.up_proj.weight"])
    # A fused parameter asked for by its own state-dict name comes whole, beside its stored parts.
    fused, part = "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.3.down_proj.weight"
    got = dict(trainer.served_tensors([fused, part]))
    assert torch.equal(got[part], got[fused][3]) and got[fused].shape == (8, 128, 64)
