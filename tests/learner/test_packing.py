"""Sequence packing: a micro-batch's sequences end to end in one row, no padding, each attending to itself.

The packed forward must give the padded layout's log-probs, entropies and
gradients, and a packed step the padded step (float32, CPU: the attention
a sequence at a time, ``services.learner.attention``), while the tokens
the body computes fall from the padded share to none.
"""

from __future__ import annotations

import copy
import math
import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from asymptote.errors import ConfigError
from benchmarks.gpu import QUICK, long_tailed_groups
from services.learner.attention import PACKED, is_packed, use_packed_attention
from services.learner.config import OptimizerSettings
from services.learner.model import PolicyForward
from services.learner.trainer import Trainer, collate, select_rows

sys.path.insert(0, str(Path(__file__).parent))
from ddp_worker import CONFIGS, batch, tiny_model

TOLERANCE = 1e-5
"""How far the packed layout may be from the padded one (float32): the acceptance's bound."""


TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def qwen3() -> torch.nn.Module:
    """Qwen3's q/k norms and its own head size, attention eager as the learner builds it on the CPU."""
    config = Qwen3Config(**TINY, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(5)
    model: torch.nn.Module = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model


def _forward(model: torch.nn.Module, inputs: object) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    policy = PolicyForward(model)  # type: ignore[arg-type]
    logp, entropy = policy(inputs.batch, inputs.temperature)  # type: ignore[attr-defined]
    (logp * inputs.loss_mask).sum().backward()  # type: ignore[attr-defined]
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return logp.detach(), entropy, grads


@pytest.mark.parametrize("build", [tiny_model, qwen3], ids=["llama", "qwen3"])
def test_a_packed_forward_gives_the_padded_log_probs_entropies_and_gradients(build: object) -> None:
    padded_model = build()  # type: ignore[operator]
    packed_model = copy.deepcopy(padded_model)
    use_packed_attention(packed_model)
    assert is_packed(packed_model) and not is_packed(padded_model)
    inputs = collate(batch(random.Random(3), 0, 5), pad_id=0)
    want_logp, want_entropy, want_grads = _forward(padded_model, inputs)
    got_logp, got_entropy, got_grads = _forward(packed_model, inputs)
    mask = inputs.batch.completion_mask.bool()
    assert mask.sum() > 50  # varied prompt and completion lengths: padding on both sides of most rows
    assert float((got_logp - want_logp)[mask].abs().max()) <= TOLERANCE
    assert float((got_entropy - want_entropy)[mask].abs().max()) <= TOLERANCE
    assert (got_logp[~mask] == 0).all() and (got_entropy[~mask] == 0).all()
    assert len(got_grads) == len(want_grads) > 0
    assert max(float((g - w).abs().max()) for g, w in zip(got_grads, want_grads)) <= TOLERANCE


def test_packed_sequences_do_not_see_each_other() -> None:
    model = tiny_model()
    use_packed_attention(model)
    inputs = collate(batch(random.Random(4), 0, 3), pad_id=0)
    policy = PolicyForward(model)
    rows = torch.arange(inputs.batch.input_ids.shape[0])
    with torch.no_grad():
        before, _ = policy(inputs.batch, inputs.temperature)
        changed = select_rows(inputs.batch, rows)
        ids = changed.input_ids.clone()
        real = changed.attention_mask[0].bool()
        ids[0, real] = (ids[0, real] + 7) % 64  # another first sequence, the same length
        changed = type(changed)(
            ids, changed.attention_mask, changed.position_ids, changed.prompt_len, changed.completion_mask
        )
        after, _ = policy(changed, inputs.temperature)
    mask = inputs.batch.completion_mask.bool()
    assert not torch.allclose(after[0][mask[0]], before[0][mask[0]])  # the first sequence did change
    assert torch.equal(after[1:][mask[1:]], before[1:][mask[1:]])  # and nothing after it saw that


@pytest.mark.parametrize("budget", [None, 30])
def test_a_packed_step_is_the_padded_step(budget: int | None) -> None:
    steps = [collate(batch(random.Random(9), i, 5), pad_id=0) for i in range(2)]
    trainers = {
        packing: Trainer(
            tiny_model(),
            CONFIGS["cispo-prompt-batch"],
            OptimizerSettings(lr=1e-3, warmup_steps=1),
            micro_batch_tokens=budget,
            packing=packing,
        )
        for packing in (False, True)
    }
    metrics = {packing: [t.step(s, learner_version=i) for i, s in enumerate(steps)] for packing, t in trainers.items()}
    params = max(
        float((a - b).detach().abs().max())
        for a, b in zip(trainers[False].model.parameters(), trainers[True].model.parameters(), strict=True)
    )
    moved = max(
        float((a - b).detach().abs().max())
        for a, b in zip(tiny_model().parameters(), trainers[True].model.parameters())
    )
    print(f"budget {budget}: parameters within {params:.1e} after two steps (moved {moved:.1e})")
    assert params <= TOLERANCE and moved > 1e-4
    for padded, packed in zip(metrics[False], metrics[True], strict=True):
        for key in ("loss", "optim/grad_norm", "policy/entropy", "is/rho_max", "batch/loss_tokens"):
            assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-7), key
        assert packed["perf/padding_share"] == 0.0 < padded["perf/padding_share"]


def test_padding_falls_from_most_tokens_to_none_on_long_tailed_lengths() -> None:
    """ScaleRL's lengths (log-normal about the median, cut at the cap): the padded layout's share of
    padding is the reference loop's count, the packed layout's is zero."""
    shape = QUICK.__class__(**{**QUICK.__dict__, "median_len": 16, "max_len": 96})
    groups = long_tailed_groups(shape, prompts=8)
    inputs = collate(groups, pad_id=shape.vocab - 1)
    real = sum(len(g.prompt_token_ids) + len(c.token_ids) for g in groups for c in g.completions)
    rows = sum(len(g.completions) for g in groups)
    width = shape.prompt_len + max(len(c.token_ids) for g in groups for c in g.completions)
    for packing, want in ((False, 1 - real / (rows * width)), (True, 0.0)):
        trainer = Trainer(
            tiny_model(), CONFIGS["cispo-prompt-batch"], OptimizerSettings(), micro_batch_tokens=256, packing=packing
        )
        share = trainer.padding_share(inputs, trainer.micro_batches(inputs))
        print(f"packing {packing}: {share:.1%} of the tokens through the body are padding")
        assert math.isclose(share, want, abs_tol=1e-12)
        if not packing:
            assert share > 0.5  # most of a padded long-tailed batch is padding
    assert want <= 0.05


def test_sliding_window_attention_is_refused_packed_and_runs_padded() -> None:
    config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ConfigError, match=r"sliding-window.*packing: false"):
        Trainer(AutoModelForCausalLM.from_config(config), CONFIGS["cispo-prompt-batch"], OptimizerSettings())
    trainer = Trainer(
        AutoModelForCausalLM.from_config(config), CONFIGS["cispo-prompt-batch"], OptimizerSettings(), packing=False
    )
    assert not is_packed(trainer.model) and trainer.model.config._attn_implementation != PACKED


def test_a_packed_model_still_scores_padded_rows_exactly() -> None:
    """Reference loops, sampling and tools call the model with padded rows and a mask: SDPA's answer."""
    plain = tiny_model()
    packed = copy.deepcopy(plain)
    use_packed_attention(packed)
    b = collate(batch(random.Random(5), 0, 4), pad_id=0).batch
    with torch.no_grad():
        want = plain(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
        got = packed(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    real = b.attention_mask.bool()
    assert float((got - want)[real].abs().max()) <= TOLERANCE
