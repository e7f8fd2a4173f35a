"""Micro-batches, activation checkpointing, whole-state checkpoints and layer discovery, in one process.

A step split into micro-batches by a token budget, or with every decoder
layer recomputed in the backward pass, must be the whole-batch step: the
same gradients, the same parameters after AdamW and the same metrics
(measured: gradients within 1.1e-7, parameters within 1.7e-7 at lr 1e-3). The multi-rank
versions of these checks (FSDP2 over two gloo ranks) are in
test_distributed.py.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from asymptote.errors import ModelError
from services.embedded.build import ModelSpec, build_model, build_tokenizer
from services.learner import checkpoint
from services.learner.config import LearnerConfig, OptimizerSettings
from services.learner.distributed import DataParallel
from services.learner.layers import decoder_layers
from services.learner.model import aliases
from services.learner.sharding import checkpoint_activations, resolve_parallelism
from services.learner.trainer import StepInputs, Trainer, collate
from services.learner.weights import WeightStore

sys.path.insert(0, str(Path(__file__).parent))
from ddp_worker import CONFIGS, batch, tiny_model

EXACT = 1e-6
"""How far a micro-batched or recomputed step may be from the whole-batch step (float32)."""


def batches(steps: int = 3) -> list[StepInputs]:
    rng = random.Random(7)
    return [collate(batch(rng, step, 5), pad_id=0) for step in range(steps)]


LR = 1e-3
"""AdamW's first steps move each weight by about lr whatever its gradient's size, so a gradient of 1e-6
that rounds differently moves its weight by a visible fraction of lr: the parameter check reads that
fraction at a learning rate that keeps it under EXACT (at 1e-2 it reached 1.7e-6, gradients 4e-8)."""


def run(
    steps: list[StepInputs], config: str, lr: float = LR, **options: object
) -> tuple[Trainer, list[dict[str, float]]]:
    trainer = Trainer(tiny_model(), CONFIGS[config], OptimizerSettings(lr=lr, warmup_steps=1), **options)  # type: ignore[arg-type]
    return trainer, [trainer.step(inputs, learner_version=i) for i, inputs in enumerate(steps)]


@torch.no_grad()
def compare(a: Trainer, b: Trainer) -> tuple[float, float]:
    """Largest difference of the last step's gradients and of the parameters."""
    grads = max(
        (
            float((pa.grad - pb.grad).abs().max())
            for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True)
            if pa.grad is not None and pb.grad is not None
        ),
        default=0.0,
    )
    params = max(
        float((pa - pb).abs().max()) for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True)
    )
    return grads, params


def assert_same_metrics(a: list[dict[str, float]], b: list[dict[str, float]]) -> None:
    for ma, mb in zip(a, b, strict=True):
        for key in ("loss", "optim/grad_norm", "policy/entropy", "is/capped_frac", "is/rho_max", "is/rho_min"):
            assert mb[key] == pytest.approx(ma[key], rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("budget", [1, 40, 100])
def test_micro_batches_take_the_whole_batch_step(config: str, budget: int) -> None:
    steps = batches()
    whole, whole_metrics = run(steps, config)
    micro, micro_metrics = run(steps, config, micro_batch_tokens=budget)
    chunks = micro.micro_batches(steps[0])
    # Packed, a completion costs its prompt and completion tokens: runs in order, each within the budget
    # (a completion over it alone), and no run could have taken the next completion.
    cost = steps[0].batch.attention_mask.sum(1)
    spent = [int(cost[rows].sum()) for rows, _ in chunks]
    assert len(chunks) > 1  # 20 completions, split for real
    assert all(s <= budget or len(rows) == 1 for s, (rows, _) in zip(spent, chunks))
    assert all(s + int(cost[nxt[0][0]]) > budget for s, nxt in zip(spent, chunks[1:]))
    assert all(live == 1.0 for _, live in chunks)
    assert torch.equal(torch.cat([rows for rows, _ in chunks]), torch.arange(20))
    grads, params = compare(whole, micro)
    print(f"{config}, {budget} tokens: gradients within {grads:.1e}, parameters within {params:.1e}")
    assert grads <= EXACT and params <= EXACT
    assert_same_metrics(whole_metrics, micro_metrics)
    moved = max(
        float((p - q).detach().abs().max()) for p, q in zip(tiny_model().parameters(), whole.model.parameters())
    )
    assert moved > 1e-3  # the steps changed the weights: the comparison is not vacuous


@pytest.mark.parametrize("config", ["cispo-prompt-batch", "gspo-sample-batch"])
def test_activation_checkpointing_takes_the_same_step(config: str) -> None:
    steps = batches()
    plain, plain_metrics = run(steps, config)
    recomputed, recomputed_metrics = run(steps, config, activation_checkpointing=True, micro_batch_tokens=60)
    grads, params = compare(plain, recomputed)
    print(f"{config}: activation checkpointing, gradients within {grads:.1e}, parameters within {params:.1e}")
    assert grads <= EXACT and params <= EXACT
    assert_same_metrics(plain_metrics, recomputed_metrics)


def test_checkpointed_layers_are_recomputed_in_the_backward_pass() -> None:
    model = tiny_model()
    calls = []
    for i, layer in enumerate(decoder_layers(model)):
        inner = layer.forward
        layer.forward = lambda *a, _i=i, _f=inner, **k: (calls.append(_i), _f(*a, **k))[1]  # type: ignore[method-assign]
    assert checkpoint_activations(model) == 2
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False).logits.sum()
    assert calls == [0, 1]
    out.backward()
    assert calls == [0, 1, 1, 0]  # each layer's forward again, as the backward pass reaches it
    assert set(model.state_dict()) == set(tiny_model().state_dict())  # names unchanged


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_decoder_layers_are_found_from_no_split_modules(family: str) -> None:
    spec = ModelSpec(family=family, num_layers=3, hidden_size=64, num_heads=2, intermediate_size=64)  # type: ignore[arg-type]
    model = build_model(spec, build_tokenizer("abc"))
    layers = decoder_layers(model)
    assert [type(x).__name__ for x in layers] == list(model._no_split_modules) * 3
    assert layers == list(model.base_model.layers)


def test_a_model_without_no_split_modules_is_refused_by_name() -> None:
    with pytest.raises(ModelError, match="Sequential lists no _no_split_modules"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_auto_parallelism_is_ddp_on_the_cpu_and_fsdp_on_gpus() -> None:
    assert resolve_parallelism("auto", torch.device("cpu")) == "ddp"
    assert resolve_parallelism("auto", torch.device("cuda", 0)) == "fsdp"
    assert resolve_parallelism("fsdp", torch.device("cpu")) == "fsdp"
    # One rank is never wrapped, whatever the layout asked for.
    trainer = Trainer(tiny_model(), CONFIGS["cispo-prompt-batch"], OptimizerSettings(), parallelism="fsdp")
    assert not trainer.sharded and type(trainer.policy).__name__ == "PolicyForward"


def test_bad_micro_batch_budgets_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="micro_batch_tokens must be at least 1"):
        Trainer(tiny_model(), CONFIGS["cispo-prompt-batch"], OptimizerSettings(), micro_batch_tokens=0)
    with pytest.raises(ValidationError, match="micro_batch_tokens"):
        LearnerConfig(model_dir=tmp_path, micro_batch_tokens=0)
    with pytest.raises(ValidationError, match="parallelism"):
        LearnerConfig(model_dir=tmp_path, parallelism="zero3")  # type: ignore[arg-type]


def test_micro_batches_match_the_rank_with_the_most() -> None:
    inputs = batches(1)[0]  # 5 prompts x 4: ranks of two hold 12 and 8 completions
    counts, stand_ins = [], []
    for rank, mine in ((0, list(range(12))), (1, list(range(12, 20)))):
        chunks = Trainer.micro_batches(_Ranked(rank, 2), inputs)  # type: ignore[arg-type]
        counts.append(len(chunks))
        assert torch.cat([rows for rows, on in chunks if on]).tolist() == mine
        assert all(rows.tolist() == [0] for rows, on in chunks if not on)  # stand-ins score row 0, weightless
        stand_ins.append(sum(1 for _, on in chunks if not on))
    assert counts == [6, 6] and stand_ins == [0, 2]  # 2 completions each: rank 1 has 4 and 2 stand-ins


class _Ranked:
    """What ``Trainer.micro_batches`` reads of a trainer: its rank and budget."""

    model = None  # padded: every completion costs the batch's padded width

    def __init__(self, rank: int, world: int) -> None:
        self.dp = DataParallel(rank, world)
        self.micro_batch_tokens = 2 * batches(1)[0].batch.input_ids.shape[1]


def _saved(trainer: Trainer, root: Path, version: int, samples_trained: int = 0) -> Path:
    """A checkpoint of ``trainer`` at ``version`` in ``root``, written and committed."""
    trainer.checkpointer = checkpoint.Checkpointer(root, keep=1, distributed=False, rank=0)
    trainer.save(version, trainer.meta(version, version, samples_trained, ["g1", "g2"]))
    path = trainer.checkpointer.finish()
    assert path is not None and checkpoint.latest(root) == path
    return path


def test_a_checkpoint_holds_the_whole_state_by_name(tmp_path: Path) -> None:
    steps = batches()
    trainer, _ = run(steps[:2], "cispo-prompt-batch")
    path = _saved(trainer, tmp_path, 2, samples_trained=40)
    assert aliases(trainer.model) == {"lm_head.weight": "model.embed_tokens.weight"}
    # Whole tensors by parameter name, readable in one process without the trainer.
    stored = checkpoint.read_weights(path)
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(stored[name], tensor), name
    fresh = Trainer(tiny_model(), CONFIGS["cispo-prompt-batch"], OptimizerSettings(lr=1e-2, warmup_steps=1))
    restored = fresh.start(None, path)
    assert restored is not None
    assert (restored.version, restored.step, restored.samples_trained) == (2, 2, 40)
    assert restored.trained_group_ids == ("g1", "g2") and restored.stepped
    assert compare(trainer, fresh)[1] == 0.0
    assert fresh.scheduler.state_dict() == trainer.scheduler.state_dict()
    after_trainer = trainer.step(steps[2], 2)
    after_fresh = fresh.step(steps[2], 2)
    assert compare(trainer, fresh) == (0.0, 0.0)
    assert after_fresh["loss"] == after_trainer["loss"]


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path: Path) -> None:
    trainer, _ = run(batches(1), "cispo-prompt-batch")
    path = _saved(trainer, tmp_path, 1)
    config = tiny_model().config
    config.num_hidden_layers += 1
    bigger = Trainer(type(tiny_model())(config), CONFIGS["cispo-prompt-batch"], OptimizerSettings())
    with pytest.raises(ModelError, match=r"does not fit the model: .*model\.layers\.2\."):
        bigger.start(None, path)


def test_served_tensors_must_be_the_model_directory_s() -> None:
    model = tiny_model()
    signature = {n: ("float32", tuple(t.shape)) for n, t in model.state_dict().items()}
    store = WeightStore(signature)
    trainer = Trainer(model, CONFIGS["cispo-prompt-batch"], OptimizerSettings())
    served = store.snapshot_tensors(1, trainer.served_tensors(store.names))
    assert served.digest == WeightStore(signature).snapshot(1, model).digest
    with pytest.raises(KeyError, match=re.escape("no tensors given for ['model.norm.weight']")):
        store.snapshot_tensors(2, ((n, t) for n, t in model.state_dict().items() if n != "model.norm.weight"))
    with pytest.raises(KeyError, match=re.escape("extra.weight is not one of the model directory's tensors")):
        store.snapshot_tensors(2, [("extra.weight", torch.zeros(1))])
    with pytest.raises(KeyError, match=re.escape("model has no parameters named ['nope']")):
        trainer.served_tensors(["nope"])


def test_a_checkpoint_before_the_first_step_leaves_the_optimizer_fresh(tmp_path: Path) -> None:
    steps = batches(1)
    trainer = Trainer(tiny_model(), CONFIGS["cispo-prompt-batch"], OptimizerSettings(lr=1e-2, warmup_steps=1))
    path = _saved(trainer, tmp_path, 0)
    assert not trainer.optimizer.state  # saving took no step
    assert not [k for k in checkpoint.weight_names(path) if "optim" in k]
    fresh = Trainer(tiny_model(), CONFIGS["cispo-prompt-batch"], OptimizerSettings(lr=1e-2, warmup_steps=1))
    restored = fresh.start(None, path)
    assert restored is not None and not restored.stepped
    assert not fresh.optimizer.state
    trainer.step(steps[0], 0)
    fresh.step(steps[0], 0)
    assert compare(trainer, fresh) == (0.0, 0.0)
    assert int(fresh.optimizer.state[next(fresh.model.parameters())]["step"]) == 1
