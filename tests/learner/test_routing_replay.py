"""Rollout routing replay (R3) in the learner's mixture-of-experts routers.

A tiny Qwen3-MoE from the model builder (3 layers, the first dense, 8
experts, top-2, float32): replaying the model's own routing must give its
own forward and step exactly, packed or padded, in micro-batches and with
activation checkpointing; replaying other experts must give what a slow
token-by-token loop over the replayed experts gives, gradient of the router
included, which a replay that gathers gate weights after the learner's own
top-k zeroed the rest does not; the step metrics count the decisions that
differ; bad routing is refused in one line that names it.
"""

from __future__ import annotations

import copy
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3MoeConfig

from asymptote.errors import ConfigError, PayloadError
from services.learner import routing
from services.learner.attention import use_packed_attention
from services.learner.config import LossSettings, MoeSettings, OptimizerSettings
from services.learner.model import PolicyForward, pack
from services.learner.routing import RouterReplay, RouterReport, routing_dtype
from services.learner.trainer import StepInputs, Trainer, collate
from tests.helpers.badinput import BAD_INPUTS

sys.path.insert(0, str(Path(__file__).parent))
from ddp_worker import batch, tiny_model

EXACT = 1e-6
"""The acceptance's bound (float32): replaying a model's own routing reproduces its forward to this."""

MOE_LAYERS, NUM_EXPERTS, TOP_K = 2, 8, 2


@pytest.fixture(scope="module")
def model_dir(moe_dir: Path) -> Path:
    return moe_dir  # conftest's tiny Qwen3-MoE


@pytest.fixture(scope="module")
def loaded(moe_loaded: PreTrainedModel) -> PreTrainedModel:
    return moe_loaded


@pytest.fixture
def model(loaded: PreTrainedModel) -> PreTrainedModel:
    return copy.deepcopy(loaded)


@pytest.fixture(scope="module")
def inputs() -> StepInputs:
    """Varied prompt and completion lengths (padding on both sides of most rows), a flat group, masked tokens."""
    return collate(batch(random.Random(3), 0, 5), pad_id=0)


def own_routing(model: PreTrainedModel, inputs: StepInputs, packed: bool) -> torch.Tensor:
    """[N, L + T, MoE layers, k] the experts ``model``'s routers pick for the batch, as the generator records
    them (its own forward, nothing replayed)."""
    model = copy.deepcopy(model)
    if packed:
        use_packed_attention(model)
    report = RouterReport(keep_own=True)
    with torch.no_grad():
        PolicyForward(model, replay=RouterReplay.install(model))(inputs.batch, inputs.temperature, report)
    assert report.own is not None
    return report.own


def with_routing(inputs: StepInputs, routing: torch.Tensor) -> StepInputs:
    """``inputs`` with ``routing`` [N, L + T, layers, k] sent as a generator sends it: each row's prompt and
    completion tokens but the last, in uint8, laid out again by ``pack``."""
    b = inputs.batch
    prompts, completions, rows = [], [], []
    for n in range(b.input_ids.shape[0]):
        real = b.attention_mask[n].bool()
        prompts.append(b.input_ids[n, : b.prompt_len][real[: b.prompt_len]].tolist())
        completions.append(b.input_ids[n, b.prompt_len :][b.completion_mask[n].bool()].tolist())
        rows.append(routing[n][real][:-1].to(routing_dtype(NUM_EXPERTS)))
    repacked = pack(prompts, completions, 0, routing=rows)
    assert torch.equal(repacked.input_ids, b.input_ids) and repacked.routed is not None
    assert repacked.routing is not None and repacked.routing.dtype == torch.uint8
    return replace(inputs, batch=repacked)


def other_routing(inputs: StepInputs, seed: int = 0) -> torch.Tensor:
    """Random distinct experts for every token and MoE layer: most of them not the model's own."""
    gen = torch.Generator().manual_seed(seed)
    shape = (*inputs.batch.input_ids.shape, MOE_LAYERS)
    scores = torch.rand((*shape, NUM_EXPERTS), generator=gen)
    return scores.topk(TOP_K, dim=-1).indices


def forward(
    model: PreTrainedModel, inputs: StepInputs, report: RouterReport | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    policy = PolicyForward(model, replay=RouterReplay.install(model))
    with torch.no_grad():
        return policy(inputs.batch, inputs.temperature, report)


def test_the_builder_makes_a_qwen3_moe_with_a_dense_first_layer(model_dir: Path, loaded: PreTrainedModel) -> None:
    config = loaded.config
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (NUM_EXPERTS, TOP_K, True)
    assert config.mlp_only_layers == [0] and config.hidden_size % 32 == 0
    assert not hasattr(loaded.model.layers[0].mlp, "gate")  # dense
    replay = RouterReplay.install(copy.deepcopy(loaded))
    assert replay is not None and replay.layout.moe_layers == (1, 2)
    # The learner reads the per-expert checkpoint into transformers' fused expert tensors, as transformers does.
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir))
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert loaded.get_parameter("model.layers.1.mlp.experts.gate_up_proj").abs().sum() > 0


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replaying_its_own_routing_reproduces_the_models_forward(
    model: PreTrainedModel, inputs: StepInputs, packed: bool
) -> None:
    plain = copy.deepcopy(model)  # no replay installed: transformers' own forward
    if packed:
        use_packed_attention(model)
        use_packed_attention(plain)
    with torch.no_grad():
        want_logp, want_entropy = PolicyForward(plain)(inputs.batch, inputs.temperature)
    replayed = with_routing(inputs, own_routing(model, inputs, packed))
    report = RouterReport()
    logp, entropy = forward(model, replayed, report)
    mask = inputs.batch.completion_mask.bool()
    err = max(float((logp - want_logp)[mask].abs().max()), float((entropy - want_entropy)[mask].abs().max()))
    print(f"{'packed' if packed else 'padded'}: replaying its own routing, log-probs within {err:.1e}")
    assert err <= EXACT
    assert report.differing is not None and int(report.differing) == 0
    # Every real token but each row's last was recorded, in each MoE layer.
    rows = inputs.batch.input_ids.shape[0]
    assert report.decisions is not None and int(report.decisions) == MOE_LAYERS * (
        int(inputs.batch.attention_mask.sum()) - rows
    )


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("packed", "micro_batch_tokens", "checkpointing"),
    [(True, 40, True), (False, 60, True), (True, None, False)],
    ids=["packed-micro-checkpointed", "padded-micro-checkpointed", "packed-whole"],
)
def test_a_step_replaying_its_own_routing_is_the_models_own_step(
    loaded: PreTrainedModel, inputs: StepInputs, packed: bool, micro_batch_tokens: int | None, checkpointing: bool
) -> None:
    """Micro-batches and activation checkpointing (the recompute replays the same experts) change nothing."""
    opt = OptimizerSettings(lr=1e-3, warmup_steps=0, max_grad_norm=1e9)
    reference = Trainer(
        copy.deepcopy(loaded), LossSettings(), opt, packing=packed, moe=MoeSettings(routing_replay=False)
    )
    trainer = Trainer(
        copy.deepcopy(loaded),
        LossSettings(),
        opt,
        packing=packed,
        micro_batch_tokens=micro_batch_tokens,
        activation_checkpointing=checkpointing,
    )
    assert len(trainer.micro_batches(inputs)) > (1 if micro_batch_tokens else 0)
    want = reference.step(inputs, learner_version=0)
    got = trainer.step(with_routing(inputs, own_routing(loaded, inputs, packed)), learner_version=0)
    want_grads, got_grads = _grads(reference), _grads(trainer)
    assert want_grads.keys() == got_grads.keys() and any("mlp.gate.weight" in n for n in got_grads)
    err = max(float((got_grads[n] - g).abs().max()) for n, g in want_grads.items())
    scale = max(float(g.abs().max()) for g in want_grads.values())
    print(f"packed {packed}, micro-batch {micro_batch_tokens}, checkpointing {checkpointing}: grads within {err:.1e}")
    assert err <= EXACT * scale
    # The step's scalars are means of per-token terms of order one (log-probs, ratios) that partly cancel:
    # summed over micro-batches in another order, float32 rounds them at the terms' scale, not the mean's.
    for key in ("loss", "optim/grad_norm", "policy/entropy", "is/kl_gen_learner"):
        assert got[key] == pytest.approx(want[key], rel=EXACT, abs=EXACT), key
    assert got["moe/routing_differs_frac"] == 0.0


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_checkpointed_layers_recompute_replays_the_same_experts(
    loaded: PreTrainedModel, inputs: StepInputs, packed: bool
) -> None:
    """Replaying other experts than the model's own: a recompute that let the router pick would differ."""
    opt = OptimizerSettings(lr=1e-3, warmup_steps=0, max_grad_norm=1e9)
    trainers = [
        Trainer(copy.deepcopy(loaded), LossSettings(), opt, packing=packed, activation_checkpointing=checkpointing)
        for checkpointing in (False, True)
    ]
    replayed = with_routing(inputs, other_routing(inputs))
    metrics = [t.step(replayed, learner_version=0) for t in trainers]
    want, got = (_grads(t) for t in trainers)
    err = max(float((got[n] - g).abs().max()) for n, g in want.items())
    print(f"{'packed' if packed else 'padded'}, other experts: checkpointed grads within {err:.1e}")
    assert err <= EXACT * max(float(g.abs().max()) for g in want.values())
    assert metrics[0]["moe/routing_differs_frac"] == metrics[1]["moe/routing_differs_frac"] > 0.5


# -- the router's gradient, against a slow token-by-token loop ------------------------------------------


class LoopMoe(torch.nn.Module):
    """An MoE block computed one token at a time over given experts: the obvious reference.

    Gate weights: the softmax of the token's router logits over all experts,
    at the given experts, renormalised over them (Qwen3-MoE's norm_topk_prob).
    Records its own top-k for the metric's reference.
    """

    def __init__(self, block: torch.nn.Module, experts: torch.Tensor) -> None:
        super().__init__()
        self.gate, self.fused = block.gate, block.experts
        self.experts = experts  # [tokens, k] in the block's token order
        self.own: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        width = self.fused.down_proj.shape[-1]
        outputs = []
        own = []
        for t in range(x.shape[0]):
            probs = torch.softmax(self.gate.weight @ x[t], dim=-1)
            own.append(probs.topk(TOP_K).indices)
            ids = self.experts[t]
            weights = probs[ids] / probs[ids].sum()
            y = torch.zeros_like(x[t])
            for w, e in zip(weights, ids.tolist(), strict=True):
                gate_up = self.fused.gate_up_proj[e] @ x[t]
                y = y + w * (self.fused.down_proj[e] @ (F.silu(gate_up[:width]) * gate_up[width:]))
            outputs.append(y)
        self.own = torch.stack(own)
        return torch.stack(outputs).view_as(hidden)


def _router_grads(model: PreTrainedModel) -> torch.Tensor:
    return torch.cat([model.get_parameter(f"model.layers.{i}.mlp.gate.weight").grad.flatten() for i in (1, 2)])


def replay_against_the_loop(
    model: PreTrainedModel, inputs: StepInputs
) -> tuple[float, float, float, RouterReport, list[torch.Tensor]]:
    """Replay other experts than the model's own (padded layout) in the learner and in the loop; returns
    the log-probs' largest difference, the router gradients' largest difference and largest value, the
    learner's report and the loop's own top-k per MoE layer."""
    chosen = other_routing(inputs)
    loop_model = copy.deepcopy(model)
    loops = []
    for m, i in enumerate((1, 2)):
        layer = loop_model.model.layers[i]
        layer.mlp = LoopMoe(layer.mlp, chosen[:, :, m].flatten(0, 1))
        loops.append(layer.mlp)
    mask = inputs.batch.completion_mask.bool()
    want_logp, _ = PolicyForward(loop_model)(inputs.batch, inputs.temperature)
    (want_logp * mask).sum().backward()
    # Every position replayed, padding too: the loop routes those to the chosen experts as well.
    everywhere = torch.ones_like(inputs.batch.attention_mask, dtype=torch.bool)
    replayed = replace(inputs, batch=replace(inputs.batch, routing=chosen.to(torch.uint8), routed=everywhere))
    report = RouterReport(keep_own=True)
    logp, _ = PolicyForward(model, replay=RouterReplay.install(model))(replayed.batch, inputs.temperature, report)
    (logp * mask).sum().backward()
    want, got = _router_grads(loop_model), _router_grads(model)
    logp_err = float((logp - want_logp).detach()[mask].abs().max())
    return logp_err, float((got - want).abs().max()), float(want.abs().max()), report, [lp.own for lp in loops]


def test_the_gradient_reaches_the_router_through_every_replayed_expert(
    model: PreTrainedModel, inputs: StepInputs
) -> None:
    logp_err, grad_err, grad_max, report, loop_own = replay_against_the_loop(model, inputs)
    print(
        f"replaying other experts: log-probs within {logp_err:.1e}, router grads within {grad_err:.1e} of {grad_max:.1e}"
    )
    assert logp_err <= 1e-5 and grad_err <= 1e-4 * grad_max and grad_max > 0
    # The share of decisions that differ: the learner's own top-k beside the replayed experts, as the loop sees it.
    assert report.own is not None and report.differing is not None and report.decisions is not None
    chosen = other_routing(inputs)
    for m in range(MOE_LAYERS):
        assert torch.equal(report.own[:, :, m].flatten(0, 1).sort(-1).values, loop_own[m].sort(-1).values)
    differs = (chosen.sort(-1).values != report.own.sort(-1).values).any(-1).sum()
    assert int(report.differing) == int(differs) and int(report.decisions) == chosen[..., 0].numel()
    assert int(report.differing) > 0.5 * int(report.decisions)


def _gathered_after_top_k_zeroing(logits: torch.Tensor, experts: torch.Tensor, renormalise: bool) -> torch.Tensor:
    """The bug R3 implementations met (Megatron-LM fork PR #79): gate weights gathered from the router's own
    top-k scores, zero for every other expert."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = probs.topk(experts.shape[-1], dim=-1)
    values = top.values / top.values.sum(dim=-1, keepdim=True) if renormalise else top.values
    return torch.zeros_like(probs).scatter(-1, top.indices, values).gather(-1, experts)


def test_the_router_check_fails_when_gate_weights_are_gathered_after_top_k_zeroing(
    model: PreTrainedModel, inputs: StepInputs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(routing, "replayed_gate_weights", _gathered_after_top_k_zeroing)
    logp_err, grad_err, grad_max, _, _ = replay_against_the_loop(model, inputs)
    print(f"gathered after top-k zeroing: log-probs off by {logp_err:.1e}, router grads by {grad_err:.1e}")
    assert logp_err > 1e-3 and grad_err > 0.1 * grad_max


# -- settings and bad inputs -------------------------------------------------------------------------


def test_the_load_balancing_loss_is_the_models_own_and_trains_the_router(
    loaded: PreTrainedModel, inputs: StepInputs
) -> None:
    coef = 0.5
    opt = OptimizerSettings(lr=1e-3, warmup_steps=0, max_grad_norm=1e9)
    replayed = with_routing(inputs, own_routing(loaded, inputs, packed=False))
    trainers = {
        c: Trainer(copy.deepcopy(loaded), LossSettings(), opt, packing=False, moe=MoeSettings(load_balancing_coef=c))
        for c in (0.0, coef)
    }
    metrics = {c: t.step(replayed, learner_version=0) for c, t in trainers.items()}
    assert "moe/load_balancing_loss" not in metrics[0.0]
    reference = copy.deepcopy(loaded)
    b = inputs.batch
    out = reference(
        input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids, output_router_logits=True
    )
    assert metrics[coef]["moe/load_balancing_loss"] == pytest.approx(float(out.aux_loss.detach()), rel=1e-6)
    out.aux_loss.backward()
    name = "model.layers.2.mlp.gate.weight"
    extra = trainers[coef].model.get_parameter(name).grad - trainers[0.0].model.get_parameter(name).grad
    torch.testing.assert_close(extra, coef * reference.get_parameter(name).grad, rtol=1e-4, atol=1e-7)
    assert (
        Trainer(
            copy.deepcopy(loaded), LossSettings(), opt, moe=MoeSettings(load_balancing_coef="model")
        ).load_balancing_coef
        == 0.001
    )


def test_a_dense_model_has_no_routers_to_replay_or_balance(inputs: StepInputs) -> None:
    trainer = Trainer(tiny_model(), LossSettings(), OptimizerSettings())
    assert trainer.replay is None
    assert not any(k.startswith("moe/") for k in trainer.step(inputs, learner_version=0))
    with pytest.raises(ConfigError, match=r"^moe.load_balancing_coef is 0.01, but LlamaForCausalLM has no routers$"):
        Trainer(tiny_model(), LossSettings(), OptimizerSettings(), moe=MoeSettings(load_balancing_coef=0.01))


def _refused(trainer: Trainer, inputs: StepInputs, what: str, match: str) -> None:
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with BAD_INPUTS.trying("learner batch", what), pytest.raises(PayloadError, match=match) as caught:
        trainer.step(inputs, learner_version=0)
    assert "\n" not in str(caught.value)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # nothing trained


def _with(inputs: StepInputs, routing: torch.Tensor) -> StepInputs:
    return replace(inputs, batch=replace(inputs.batch, routing=routing, routed=inputs.batch.attention_mask.bool()))


def test_bad_routing_is_refused_in_one_line_that_names_it(loaded: PreTrainedModel, inputs: StepInputs) -> None:
    trainer = Trainer(copy.deepcopy(loaded), LossSettings(), OptimizerSettings())
    good = other_routing(inputs).to(torch.uint8)
    _refused(
        trainer,
        inputs,
        "no routing",
        r"no routing, but Qwen3MoeForCausalLM is a mixture of experts.*moe.routing_replay",
    )
    _refused(
        trainer,
        _with(inputs, good[:, :, :1]),
        "one MoE layer",
        r"shape \[20, 14, 1, 2\] does not fit.*2 MoE layers, top-2",
    )
    _refused(trainer, _with(inputs, good[..., :1]), "top-1", r"does not fit Qwen3MoeForCausalLM: .*top-2\]")
    beyond = good.clone()
    beyond[3, -2, 1, 0] = NUM_EXPERTS
    _refused(
        trainer, _with(inputs, beyond), "expert 8", r"names expert 8, but .* has 8 experts per MoE layer \(ids 0-7\)"
    )
    _refused(trainer, _with(inputs, good.float()), "float ids", r"routing in torch.float32 is not integer expert ids")
    with BAD_INPUTS.trying("learner batch", "routing one token short"), pytest.raises(PayloadError) as caught:
        pack([[1, 2, 3]], [[4, 5]], 0, routing=[torch.zeros((3, 2, 2), dtype=torch.uint8)])
    assert str(caught.value) == (
        "row 0's routing covers 3 tokens, its prompt and completion are 5 (3 + 2): it takes 4 (all but the last) or 5"
    )


def test_a_model_with_more_experts_than_the_dtype_holds_is_refused(inputs: StepInputs) -> None:
    config = Qwen3MoeConfig(
        vocab_size=32, hidden_size=32, intermediate_size=32, moe_intermediate_size=4, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=300, num_experts_per_tok=2,
        norm_topk_prob=True,
    )  # fmt: skip
    trainer = Trainer(AutoModelForCausalLM.from_config(config), LossSettings(), OptimizerSettings())
    routing_u8 = torch.zeros((*inputs.batch.input_ids.shape, 1, 2), dtype=torch.uint8)
    _refused(
        trainer,
        _with(inputs, routing_u8),
        "300 experts in uint8",
        r"^routing in uint8 holds expert ids up to 255, but Qwen3MoeForCausalLM has 300 experts per MoE layer: "
        r"send uint16$",
    )
    assert (routing_dtype(256), routing_dtype(257), routing_dtype(65536)) == (torch.uint8, torch.uint16, torch.uint16)
    with pytest.raises(ValueError, match="65537 experts: more than 65536"):
        routing_dtype(65537)


def test_replay_is_off_when_asked_and_the_routers_pick_their_own(loaded: PreTrainedModel, inputs: StepInputs) -> None:
    opt = OptimizerSettings(lr=1e-3, warmup_steps=0)
    off = Trainer(copy.deepcopy(loaded), LossSettings(), opt, moe=MoeSettings(routing_replay=False))
    plain = Trainer(copy.deepcopy(loaded), LossSettings(), opt, moe=MoeSettings(routing_replay=False))
    with_other = _with(inputs, other_routing(inputs).to(torch.uint8))
    a, b = off.step(with_other, learner_version=0), plain.step(inputs, learner_version=0)
    assert a["loss"] == b["loss"] and a["moe/routing_differs_frac"] == 0.0


@pytest.fixture(autouse=True, scope="module")
def _timed() -> Iterator[None]:
    started = time.perf_counter()
    yield
    print(f"\nrouting replay tests: {time.perf_counter() - started:.1f} s")
