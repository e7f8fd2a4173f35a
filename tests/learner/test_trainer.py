"""collate() lays groups out exactly; forward() scores what the generator sampled."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asymptote.contracts.v1 import rollout_pb2, services_pb2
from asymptote.errors import PayloadError
from services.broker.batcher import Batcher
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.model import PolicyForward, pack
from services.learner.trainer import Trainer, collate

PAD = 0
Span = tuple[int, int, int]  # (version, start, end)


def completion(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    spans: Sequence[Span],
    reward: float,
    loss_mask: Sequence[int] = (),
    truncated: bool = False,
) -> rollout_pb2.Completion:
    return rollout_pb2.Completion(
        token_ids=list(token_ids),
        logprobs=list(logprobs),
        version_spans=[rollout_pb2.VersionSpan(version=v, start=a, end=b) for v, a, b in spans],
        reward=reward,
        loss_mask=list(loss_mask),
        truncated=truncated,
    )


def group(
    group_id: str, prompt: Sequence[int], completions: Sequence[rollout_pb2.Completion], temperature: float = 0.0
) -> rollout_pb2.RolloutGroup:
    task = rollout_pb2.GenerationTask(task_id=group_id, sampling=rollout_pb2.SamplingParams(temperature=temperature))
    return rollout_pb2.RolloutGroup(
        group_id=group_id, task=task, prompt_token_ids=list(prompt), completions=list(completions)
    )


def two_groups() -> list[rollout_pb2.RolloutGroup]:
    """Prompts of 3 and 2 tokens; completions of 3, 1, 4 and 2 tokens; one with injected tokens."""
    g0 = group(
        "g0",
        prompt=[1, 5, 6],
        completions=[
            # sampled by version 3 then 4 (an in-flight weight swap after token 2)
            completion([7, 8, 2], [-0.5, -0.25, -1.0], [(3, 0, 2), (4, 2, 3)], reward=1.0),
            completion([9], [-1.5], [(4, 0, 1)], reward=0.0, truncated=True),
        ],
    )
    g1 = group(
        "g1",
        prompt=[1, 5],
        completions=[
            # tokens 1-2 are the injected "time is up" phrase: mask 0
            completion([7, 7, 7, 7], [-0.125, -2.0, -3.0, -0.75], [(5, 0, 4)], 1.0, loss_mask=[1, 0, 0, 1]),
            completion([8, 2], [-0.0625, -4.0], [(5, 0, 1), (6, 1, 2)], -1.0, loss_mask=[1, 1]),
        ],
        temperature=0.7,
    )
    return [g0, g1]


def test_collate_lays_out_every_tensor() -> None:
    inputs = collate(two_groups(), pad_id=PAD)
    b = inputs.batch
    assert b.prompt_len == 3
    assert b.input_ids.tolist() == [
        [1, 5, 6, 7, 8, 2, PAD],
        [1, 5, 6, 9, PAD, PAD, PAD],
        [PAD, 1, 5, 7, 7, 7, 7],
        [PAD, 1, 5, 8, 2, PAD, PAD],
    ]
    assert b.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 1, 1, 1],
        [0, 1, 1, 1, 1, 0, 0],
    ]
    # Positions count from each row's first real token, as in an unpadded run.
    assert [row[i] for row, m in zip(b.position_ids.tolist(), b.attention_mask.tolist()) for i in range(7) if m[i]] == [
        0, 1, 2, 3, 4, 5,
        0, 1, 2, 3,
        0, 1, 2, 3, 4, 5,
        0, 1, 2, 3,
    ]  # fmt: skip
    assert b.completion_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    torch.testing.assert_close(
        inputs.logp_gen,
        torch.tensor(
            [
                [-0.5, -0.25, -1.0, 0.0],
                [-1.5, 0.0, 0.0, 0.0],
                [-0.125, -2.0, -3.0, -0.75],
                [-0.0625, -4.0, 0.0, 0.0],
            ]
        ),
        rtol=0,
        atol=0,
    )
    # Empty loss_mask means every real token; padding is always 0; injected tokens 0.
    assert inputs.loss_mask.dtype == torch.float32
    assert inputs.loss_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 1], [1, 1, 0, 0]]
    assert inputs.token_versions.dtype == torch.long
    assert inputs.token_versions.tolist() == [[3, 3, 4, 0], [4, 0, 0, 0], [5, 5, 5, 5], [5, 6, 0, 0]]
    assert inputs.prompt_index.tolist() == [0, 0, 1, 1]
    assert inputs.rewards.tolist() == [[1.0, 0.0], [1.0, -1.0]]
    # Temperature 0 on the wire means unset: the learner scores at 1.
    torch.testing.assert_close(inputs.temperature, torch.tensor([1.0, 1.0, 0.7, 0.7]))
    assert inputs.truncated.tolist() == [False, True, False, False]
    assert inputs.num_prompts == 2


def test_collate_uses_the_given_pad_id() -> None:
    inputs = collate(two_groups(), pad_id=3)
    assert inputs.batch.input_ids[1].tolist() == [1, 5, 6, 9, 3, 3, 3]
    assert inputs.batch.input_ids[2, 0].item() == 3
    # the pad id appears as a real token nowhere else: masks still come from lengths
    assert inputs.loss_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 1], [1, 1, 0, 0]]


def test_collate_rejects_groups_of_different_sizes() -> None:
    g0, g1 = two_groups()
    g1.completions.append(completion([4], [-0.5], [(5, 0, 1)], reward=1.0))
    with pytest.raises(PayloadError, match="g1 has 3 episodes, the batch has 2"):
        collate([g0, g1], pad_id=PAD)
    with pytest.raises(PayloadError, match="empty batch"):
        collate([], pad_id=PAD)


# --------------------------------------------------------------------------
# forward(): log-probs at the sampling temperature, padding-invariant
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=PAD,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        # A sharper than default init so that temperatures change the log-probs visibly.
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 1.0)
    return model.float().eval()


def reference_logprobs(
    model: LlamaForCausalLM, prompt: list[int], completion_ids: list[int], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of each completion token from the unpadded sequence alone."""
    ids = torch.tensor([prompt + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp, entropy = [], []
    for t, token in enumerate(completion_ids):
        dist = torch.log_softmax(logits[len(prompt) - 1 + t] / temperature, dim=-1)
        logp.append(dist[token])
        entropy.append(-(dist.exp() * dist).sum())
    return torch.stack(logp).float(), torch.stack(entropy).float()


def test_forward_matches_unpadded_log_softmax_at_temperature(tiny_llama: LlamaForCausalLM) -> None:
    prompts = [[1, 5, 6, 9, 4], [1, 5], [1, 12, 3], [1, 12, 3]]
    completions = [[7, 8, 2], [9], [4, 4, 15, 2, 11], [4, 4, 15, 2, 11]]
    temperatures = [1.0, 0.7, 0.5, 2.0]
    batch = pack(prompts, completions, PAD)
    assert batch.attention_mask[1, :3].tolist() == [0, 0, 0]  # row 1 is left-padded by 3
    with torch.no_grad():
        logp, entropy = PolicyForward(tiny_llama)(batch, torch.tensor(temperatures))
    assert logp.dtype == torch.float32
    for n, (p, c, temp) in enumerate(zip(prompts, completions, temperatures)):
        ref_logp, ref_entropy = reference_logprobs(tiny_llama, p, c, temp)
        torch.testing.assert_close(logp[n, : len(c)], ref_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy[n, : len(c)], ref_entropy, rtol=1e-5, atol=1e-5)
    # Same tokens at another temperature score differently: the division happened per row.
    assert (logp[2] - logp[3]).abs().max() > 1e-2
    assert entropy[3].mean() > entropy[2].mean()


def test_forward_is_differentiable(tiny_llama: LlamaForCausalLM) -> None:
    model = copy.deepcopy(tiny_llama)
    batch = pack([[1, 5], [1, 5, 6]], [[7, 8], [9]], PAD)
    logp, _ = PolicyForward(model)(batch, torch.tensor([1.0, 1.0]))
    logp[0, 0].backward()
    assert model.lm_head.weight.grad is not None
    assert model.lm_head.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------
# Trainer.step: zero-variance prompts are out of the loss
# --------------------------------------------------------------------------


def zero_variance_group() -> rollout_pb2.RolloutGroup:
    return group(
        "zv",
        prompt=[1, 6],
        completions=[
            completion([11, 12, 2], [-0.5, -0.5, -0.5], [(5, 0, 3)], reward=1.0),
            completion([13], [-0.5], [(5, 0, 1)], reward=1.0),
        ],
    )


@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_step_loss_ignores_zero_variance_prompts(tiny_llama: LlamaForCausalLM, aggregation: str) -> None:
    """A zero-variance group in the batch changes neither the loss nor the update."""
    loss_settings = LossSettings(aggregation=aggregation)  # type: ignore[arg-type]
    opt = OptimizerSettings(lr=1e-2, warmup_steps=0, weight_decay=0.0)
    without = Trainer(copy.deepcopy(tiny_llama), loss_settings, opt)
    with_zv = Trainer(copy.deepcopy(tiny_llama), loss_settings, opt)
    m1 = without.step(collate(two_groups(), PAD), learner_version=6)
    m2 = with_zv.step(collate([*two_groups(), zero_variance_group()], PAD), learner_version=6)
    assert (m1["batch/kept_prompts"], m2["batch/kept_prompts"], m2["batch/prompts"]) == (2.0, 2.0, 3.0)
    assert m1["loss"] != 0.0
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
    assert m2["optim/grad_norm"] == pytest.approx(m1["optim/grad_norm"], rel=1e-4)
    for p1, p2 in zip(without.model.parameters(), with_zv.model.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6)


def test_step_with_nothing_to_learn_leaves_weights_alone(tiny_llama: LlamaForCausalLM) -> None:
    model = copy.deepcopy(tiny_llama)
    trainer = Trainer(model, LossSettings(), OptimizerSettings(lr=1e-2, warmup_steps=0))
    metrics = trainer.step(collate([zero_variance_group()], PAD), learner_version=5)
    assert metrics["loss"] == 0.0
    assert metrics["optim/grad_norm"] == 0.0
    assert metrics["batch/kept_prompts"] == 0.0
    for p0, p1 in zip(tiny_llama.parameters(), model.parameters()):
        assert torch.equal(p0, p1)


def test_lm_head_runs_in_float32_for_a_bfloat16_body() -> None:
    """FP32 LM head: with the body computing in bf16, the logits are a float32
    matmul of the hidden states and the float32 head weight, not bf16 logits
    cast afterwards."""
    from asymptote.tasks import ALPHABET
    from services.embedded.build import ModelSpec, build_model, build_tokenizer
    from services.learner.model import Precision, pack

    spec = ModelSpec(init_seed=4)
    tok = build_tokenizer(ALPHABET, spec.vocab_multiple)
    model = build_model(spec, tok)
    precision = Precision.resolve("cpu", "bfloat16", head="fp32")
    batch = pack([[1, 5, 6, 7], [1, 8, 9]], [[10, 11, 2], [12, 2]], int(tok.pad_token_id))
    temperature = torch.ones(2)
    logp, _ = PolicyForward(model, precision)(batch, temperature)
    assert logp.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float32  # master weights stay float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).last_hidden_state[:, batch.prompt_len - 1 : -1]
        bf16 = torch.log_softmax(model.lm_head(hidden).float(), -1)  # autocast: a bf16 matmul
    with torch.no_grad():
        fp32 = torch.log_softmax(hidden.float() @ model.lm_head.weight.T, -1)
    targets = batch.input_ids[:, batch.prompt_len :]
    want = fp32.gather(-1, targets[..., None]).squeeze(-1)
    rounded = bf16.gather(-1, targets[..., None]).squeeze(-1)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(logp.detach()[mask], want[mask], rtol=0, atol=1e-6)
    assert (rounded[mask] - want[mask]).abs().max() > 1e-4  # a bf16 head would differ
    # ...and the body did compute in bf16: float32 throughout gives other log-probs.
    logp32, _ = PolicyForward(model)(batch, temperature)
    assert (logp32.detach()[mask] - want[mask]).abs().max() > 1e-4
    # A bf16 body's default head is a bf16 engine's FP32 head: bf16 operands, float32 accumulation.
    auto = Precision.resolve("cpu", "bfloat16")
    assert auto.head == "bf16_fp32_acc" and Precision.resolve("cpu", "float32").head == "fp32"
    logp_acc, _ = PolicyForward(model, auto)(batch, temperature)
    with torch.no_grad():
        operands = hidden.to(torch.bfloat16).float() @ model.lm_head.weight.to(torch.bfloat16).float().T
        vllm = torch.log_softmax(operands, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(logp_acc.detach()[mask], vllm[mask], rtol=0, atol=1e-6)
    assert (logp_acc.detach()[mask] - want[mask]).abs().max() > 1e-5  # rounded operands: not the fp32 head


# --------------------------------------------------------------------------
# Batch semantics: zero_variance drop, refill and keep, broker to loss
# --------------------------------------------------------------------------


def semantics_stream() -> list[rollout_pb2.RolloutGroup]:
    """Six groups in arrival order, two of them flat (all rewards 1, all 0); lengths differ so that
    every denominator tells the modes apart. One log-ratio is large enough to cap CISPO's weight."""
    return [
        group(
            "a",
            [1, 5, 6],
            [
                completion([7, 8, 2], [-0.5, -8.0, -1.0], [(5, 0, 3)], 1.0, loss_mask=[1, 1, 0]),
                completion([9], [-1.5], [(5, 0, 1)], 0.0),
                completion([10, 11], [-2.0, -2.5], [(5, 0, 2)], 0.0),
            ],
        ),
        group(
            "flat1",
            [1, 6],
            [
                completion([11, 12, 2], [-0.5, -0.5, -0.5], [(5, 0, 3)], 1.0),
                completion([13], [-0.5], [(5, 0, 1)], 1.0),
                completion([4, 5, 6, 7], [-1.0, -1.0, -1.0, -1.0], [(5, 0, 4)], 1.0),
            ],
        ),
        group(
            "b",
            [1, 5],
            [
                completion([7, 7, 7, 7], [-0.125, -2.0, -3.0, -0.75], [(5, 0, 4)], 1.0, loss_mask=[1, 0, 0, 1]),
                completion([8, 2], [-0.0625, -4.0], [(5, 0, 2)], 1.0),
                completion([3], [-2.0], [(5, 0, 1)], 0.0),
            ],
        ),
        group(
            "flat0",
            [1, 12, 3],
            [
                completion([14, 2], [-3.0, -0.25], [(5, 0, 2)], 0.0),
                completion([15, 15, 15], [-2.0, -2.0, -2.0], [(5, 0, 3)], 0.0),
                completion([2], [-0.1], [(5, 0, 1)], 0.0),
            ],
        ),
        group(
            "c",
            [1, 9],
            [
                completion([6, 2], [-1.0, -0.5], [(5, 0, 2)], 0.0),
                completion([6, 6, 2], [-1.0, -3.0, -0.5], [(5, 0, 3)], 1.0),
                completion([5], [-0.75], [(5, 0, 1)], 1.0),
            ],
        ),
        group(
            "d",
            [1, 10, 11],
            [
                completion([12], [-2.0], [(5, 0, 1)], 1.0),
                completion([13, 2], [-2.5, -0.5], [(5, 0, 2)], 0.0),
                completion([14, 14], [-1.0, -1.0], [(5, 0, 2)], 0.0),
            ],
        ),
    ]


class FakeMsg:
    """Stands in for a JetStream message (the batcher with real ones: tests/integration/test_broker_nats.py)."""

    async def ack(self) -> None: ...
    async def nak(self, delay: float | None = None) -> None: ...
    async def in_progress(self) -> None: ...


async def broker_batch(
    mode: str, stream: Sequence[rollout_pb2.RolloutGroup], batch_prompts: int
) -> tuple[list[rollout_pb2.RolloutGroup], services_pb2.BatchHeader]:
    """The groups and header the broker hands the learner when ``stream`` arrives in order."""
    batcher = Batcher(batch_prompts=batch_prompts, max_staleness_versions=8, zero_variance=mode)  # type: ignore[arg-type]
    for g in stream:
        await batcher.admit(g, FakeMsg())
    handed = await batcher.next_batch(learner_version=5, num_groups=batch_prompts, timeout_s=1.0)
    assert handed is not None
    return [h.group for h in handed.items], batcher.header(handed)


def reference_semantics(
    model: LlamaForCausalLM, stream: Sequence[rollout_pb2.RolloutGroup], mode: str, batch_prompts: int, agg: str
) -> dict[str, float]:
    """RECIPE 1-2 and the three modes, one group, completion and token at a time (CISPO, eps_max 4).

    drop and keep take the next B groups; refill skips flat ones until B informative ones are in (the
    skipped ones are taken too). drop and refill leave flat groups out of the loss; keep counts them.
    """
    taken, batch = 0, []
    for g in stream:
        if len(batch) == batch_prompts:
            break
        taken += 1
        flat = len({c.reward for c in g.completions}) == 1
        if mode == "refill" and flat:
            continue
        batch.append(g)
    in_loss = [mode == "keep" or len({c.reward for c in g.completions}) > 1 for g in batch]
    centred = [
        [c.reward - sum(x.reward for x in g.completions) / len(g.completions) for c in g.completions] for g in batch
    ]
    values = [a for row, k in zip(centred, in_loss) if k for a in row]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    per_prompt: list[list[list[float]]] = []  # prompt -> completion -> token loss terms
    for g, row, k in zip(batch, centred, in_loss):
        completions = []
        for c, a in zip(g.completions, row):
            if not k:
                continue
            logp, _ = reference_logprobs(model, list(g.prompt_token_ids), list(c.token_ids), 1.0)
            mask = list(c.loss_mask) or [1] * len(c.token_ids)
            terms = []
            for t, lp in enumerate(logp.double().tolist()):
                if mask[t]:
                    weight = min(math.exp(lp - c.logprobs[t]), 4.0)
                    terms.append(-weight * (a / std) * lp)
            completions.append(terms)
        per_prompt.append(completions)
    if agg == "prompt":
        prompt_means = [sum(sum(c) for c in p) / sum(len(c) for c in p) for p in per_prompt if p]
        loss = sum(prompt_means) / len(prompt_means)
    elif agg == "sample":
        sample_means = [sum(c) / len(c) for p in per_prompt for c in p]
        loss = sum(sample_means) / len(sample_means)
    else:
        tokens = [x for p in per_prompt for c in p for x in c]
        loss = sum(tokens) / len(tokens)
    return {
        "loss": loss,
        "batch/prompts_taken": float(taken),
        "batch/prompts": float(len(batch)),
        "batch/kept_prompts": float(sum(in_loss)),
        "batch/effective_prompts": float(sum(1 for row in centred if any(a != 0 for a in row))),
        "batch/loss_samples": float(sum(len(p) for p in per_prompt)),
        "batch/loss_tokens": float(sum(len(c) for p in per_prompt for c in p)),
    }


@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
@pytest.mark.parametrize(
    ("mode", "denominators"),
    [
        # (taken, in batch, kept, effective, samples in the loss, tokens in the loss)
        ("drop", (4, 4, 2, 2, 6, 10)),
        ("refill", (6, 4, 4, 4, 12, 21)),
        ("keep", (4, 4, 4, 2, 12, 24)),
    ],
)
async def test_batch_semantics_loss_and_denominators_match_reference(
    tiny_llama: LlamaForCausalLM, mode: str, denominators: tuple[int, ...], aggregation: str
) -> None:
    stream = semantics_stream()
    groups, header = await broker_batch(mode, stream, batch_prompts=4)
    want = reference_semantics(tiny_llama, stream, mode, 4, aggregation)
    trainer = Trainer(copy.deepcopy(tiny_llama), LossSettings(aggregation=aggregation), OptimizerSettings())  # type: ignore[arg-type]
    got = trainer.step(collate(groups, PAD, header), learner_version=5)
    keys = ("batch/prompts_taken", "batch/prompts", "batch/kept_prompts", "batch/effective_prompts")
    keys += ("batch/loss_samples", "batch/loss_tokens")
    assert [got[k] for k in keys] == [want[k] for k in keys] == list(map(float, denominators))
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
