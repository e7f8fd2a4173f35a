"""Advantages, aggregation and CISPO against a slow reference written from RECIPE.md.

The reference works one prompt, one completion and one token at a time in
Python float64, straight from the formulas of RECIPE.md sections 1 and 2; the
vectorised code must match its loss value and its gradient w.r.t. ``logp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.learner.losses import (
    LOG_RATIO_CLAMP,
    Aggregation,
    Normalization,
    aggregate,
    cispo_loss,
    group_advantages,
    zero_variance_mask,
)

RewardKind = Literal["binary", "signed", "continuous"]
TOL = {"rtol": 1e-6, "atol": 1e-6}
NORMALIZATIONS: tuple[Normalization, ...] = get_args(Normalization)
AGGREGATIONS: tuple[Aggregation, ...] = get_args(Aggregation)


# --------------------------------------------------------------------------
# Slow reference
# --------------------------------------------------------------------------


def ref_advantages(rewards: list[list[float]], normalization: str) -> tuple[list[list[float]], list[bool]]:
    """RECIPE 1: A_i = r_i - mean_j r_j, then batch / group / no std; zero rows for dropped prompts."""
    keep = [any(r != row[0] for r in row) for row in rewards]
    centred = [[r - sum(row) / len(row) for r in row] for row in rewards]
    if normalization == "batch":
        values = [a for row, k in zip(centred, keep) if k for a in row]
        if values:
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        else:
            std = 1.0
        std = max(std, 1e-8)
        centred = [[a / std for a in row] for row in centred]
    elif normalization == "group":
        out = []
        for row in centred:
            mean = sum(row) / len(row)
            std = max(math.sqrt(sum((a - mean) ** 2 for a in row) / len(row)), 1e-8)
            out.append([a / std for a in row])
        centred = out
    return [[a if k else 0.0 for a in row] for row, k in zip(centred, keep)], keep


@dataclass
class RefResult:
    loss: torch.Tensor
    capped_frac: float
    rho_max: float
    rho_min: float


def ref_cispo(
    logp: torch.Tensor,
    logp_gen: list[list[float]],
    advantages: list[float],
    mask: list[list[int]],
    prompt_index: list[int],
    eps_max: float,
    aggregation: str,
) -> RefResult:
    """RECIPE 2: per token -sg(min(rho, eps_max)) * A * logp, aggregated token by token."""
    num_completions, num_tokens = logp.shape
    # token_terms[n] = loss terms of completion n's loss tokens
    token_terms: list[list[torch.Tensor]] = []
    rhos: list[float] = []
    for n in range(num_completions):
        terms = []
        for t in range(num_tokens):
            if not mask[n][t]:
                continue
            diff = float(logp[n, t].detach()) - logp_gen[n][t]
            diff = min(max(diff, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
            rho = math.exp(diff)
            rhos.append(rho)
            weight = min(rho, eps_max)  # a Python float: stop-gradient by construction
            terms.append(-weight * advantages[n] * logp[n, t])
        token_terms.append(terms)

    zero = logp.sum() * 0.0
    if aggregation == "token":
        all_terms = [x for terms in token_terms for x in terms]
        loss = sum(all_terms, zero) / len(all_terms) if all_terms else zero
    elif aggregation == "sample":
        per_sample = [sum(terms, zero) / len(terms) for terms in token_terms if terms]
        loss = sum(per_sample, zero) / len(per_sample) if per_sample else zero
    elif aggregation == "prompt":
        per_prompt = []
        for p in sorted(set(prompt_index)):
            terms = [x for n in range(num_completions) if prompt_index[n] == p for x in token_terms[n]]
            if terms:
                per_prompt.append(sum(terms, zero) / len(terms))
        loss = sum(per_prompt, zero) / len(per_prompt) if per_prompt else zero
    else:
        raise AssertionError(aggregation)

    if rhos:
        capped = sum(1 for r in rhos if r > eps_max) / len(rhos)
        return RefResult(loss, capped, max(rhos), min(rhos))
    return RefResult(loss, 0.0, 1.0, 1.0)


# --------------------------------------------------------------------------
# Random batches
# --------------------------------------------------------------------------


@dataclass
class Batch:
    rewards: list[list[float]]
    logp: list[list[float]]
    logp_gen: list[list[float]]
    mask: list[list[int]]
    prompt_index: list[int]

    @property
    def num_prompts(self) -> int:
        return len(self.rewards)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rewards, logp requiring grad, logp_gen, mask, prompt_index), float64."""
        return (
            torch.tensor(self.rewards, dtype=torch.float64),
            torch.tensor(self.logp, dtype=torch.float64, requires_grad=True),
            torch.tensor(self.logp_gen, dtype=torch.float64),
            torch.tensor(self.mask, dtype=torch.float64),
            torch.tensor(self.prompt_index, dtype=torch.long),
        )


def random_batch(
    seed: int,
    num_prompts: int,
    group_size: int,
    num_tokens: int,
    reward_kind: RewardKind,
    zero_variance_prob: float = 0.25,
) -> Batch:
    """Completions of random length (>= 1), right padding, some injected (mask 0) tokens.

    Padding carries garbage log-probs (logp_gen 0 as collate writes it, logp
    anything) to prove it never leaks into the loss. A quarter of the
    log-ratios are large enough that the weight is capped.
    """
    g = torch.Generator().manual_seed(seed)

    def uniform() -> float:
        return float(torch.rand((), generator=g, dtype=torch.float64))

    rewards: list[list[float]] = []
    for _ in range(num_prompts):
        if uniform() < zero_variance_prob:
            value = {"binary": 1.0, "signed": -1.0, "continuous": 0.3}[reward_kind]
            rewards.append([value] * group_size)
        elif reward_kind == "binary":
            rewards.append([float(uniform() < 0.5) for _ in range(group_size)])
        elif reward_kind == "signed":
            rewards.append([1.0 if uniform() < 0.5 else -1.0 for _ in range(group_size)])
        else:
            rewards.append([uniform() for _ in range(group_size)])

    logp, logp_gen, mask, prompt_index = [], [], [], []
    for p in range(num_prompts):
        for _ in range(group_size):
            length = 1 + int(uniform() * num_tokens) if num_tokens > 1 else 1
            row_lp, row_gen, row_mask = [], [], []
            for t in range(num_tokens):
                if t < length:
                    lp = -3.0 * uniform() - 1e-3
                    shift = 2.0 if uniform() < 0.25 else 0.0  # rho = e^(2 + ...) > 4: capped
                    row_lp.append(lp)
                    row_gen.append(lp - shift - 0.5 * (uniform() - 0.5))
                    row_mask.append(0 if uniform() < 0.2 else 1)  # injected tokens
                else:
                    row_lp.append(-7.0 * uniform())
                    row_gen.append(0.0)
                    row_mask.append(0)
            logp.append(row_lp)
            logp_gen.append(row_gen)
            mask.append(row_mask)
            prompt_index.append(p)
    return Batch(rewards, logp, logp_gen, mask, prompt_index)


def run_recipe(
    batch: Batch, normalization: Normalization, aggregation: Aggregation, eps_max: float
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float], torch.Tensor]:
    """The vectorised code used as the learner uses it: (loss, d loss / d logp, stats, keep)."""
    rewards, logp, logp_gen, mask, prompt_index = batch.tensors()
    advantages, keep = group_advantages(rewards=rewards, normalization=normalization)
    # Zero-variance prompts are dropped from the loss: none of their tokens count.
    loss_mask = mask * keep[prompt_index, None]
    loss, stats = cispo_loss(
        logp=logp,
        logp_gen=logp_gen,
        advantages=advantages.reshape(-1),
        mask=loss_mask,
        prompt_index=prompt_index,
        eps_max=eps_max,
        aggregation=aggregation,
    )
    (grad,) = torch.autograd.grad(loss, logp, allow_unused=False)
    return loss.detach(), grad, stats, keep


def run_reference(
    batch: Batch, normalization: str, aggregation: str, eps_max: float
) -> tuple[torch.Tensor, torch.Tensor, RefResult, list[bool]]:
    advantages, keep = ref_advantages(batch.rewards, normalization)
    per_completion = [advantages[p][i] for p in range(batch.num_prompts) for i in range(len(batch.rewards[p]))]
    mask = [[m if keep[p] else 0 for m in row] for row, p in zip(batch.mask, batch.prompt_index)]
    logp = torch.tensor(batch.logp, dtype=torch.float64, requires_grad=True)
    ref = ref_cispo(logp, batch.logp_gen, per_completion, mask, batch.prompt_index, eps_max, aggregation)
    if ref.loss.requires_grad:
        (grad,) = torch.autograd.grad(ref.loss, logp)
    else:
        grad = torch.zeros_like(logp)
    return ref.loss.detach(), grad, ref, keep


def assert_matches_reference(
    batch: Batch, normalization: Normalization, aggregation: Aggregation, eps_max: float
) -> None:
    loss, grad, stats, keep = run_recipe(batch, normalization, aggregation, eps_max)
    ref_loss, ref_grad, ref, ref_keep = run_reference(batch, normalization, aggregation, eps_max)
    assert keep.tolist() == ref_keep
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    assert stats["is/capped_frac"] == pytest.approx(ref.capped_frac, rel=1e-6)  # a float32 mean
    assert stats["is/rho_max"] == pytest.approx(ref.rho_max, rel=1e-9)
    assert stats["is/rho_min"] == pytest.approx(ref.rho_min, rel=1e-9)


# --------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("reward_kind", get_args(RewardKind))
def test_group_advantages_match_reference(normalization: Normalization, reward_kind: RewardKind) -> None:
    batch = random_batch(seed=7, num_prompts=6, group_size=5, num_tokens=1, reward_kind=reward_kind)
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)
    advantages, keep = group_advantages(rewards=rewards, normalization=normalization)
    ref_adv, ref_keep = ref_advantages(batch.rewards, normalization)
    assert advantages.dtype == torch.float64
    assert keep.tolist() == ref_keep
    torch.testing.assert_close(advantages, torch.tensor(ref_adv, dtype=torch.float64), **TOL)


def test_advantages_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [-1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    none, keep = group_advantages(rewards=rewards, normalization="none")
    assert keep.tolist() == [True, False, True]
    torch.testing.assert_close(
        none, torch.tensor([[0.75, -0.25, -0.25, -0.25], [0.0] * 4, [-1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    )
    # Batch std over the 8 kept advantages only: sqrt((0.75^2 + 3 * 0.25^2 + 4) / 8) = sqrt(4.75 / 8).
    batch, _ = group_advantages(rewards=rewards, normalization="batch")
    torch.testing.assert_close(batch, none / math.sqrt(4.75 / 8))
    # Group std: sqrt(3) / 4 for the first prompt, 1 for the third.
    group, _ = group_advantages(rewards=rewards, normalization="group")
    torch.testing.assert_close(group[0], none[0] / (math.sqrt(3) / 4))
    torch.testing.assert_close(group[2], none[2])
    assert group[1].abs().sum() == 0


@pytest.mark.parametrize("rows", [[[0.0, 0.0]], [[1.0, 1.0, 1.0]], [[-1.0, -1.0], [1.0, 1.0]]])
def test_zero_variance_prompts_are_not_kept(rows: list[list[float]]) -> None:
    rewards = torch.tensor(rows, dtype=torch.float64)
    assert not zero_variance_mask(rewards=rewards).any()
    for normalization in NORMALIZATIONS:
        advantages, keep = group_advantages(rewards=rewards, normalization=normalization)
        assert not keep.any()
        assert torch.isfinite(advantages).all()
        assert advantages.abs().sum() == 0


def test_signed_rewards_with_zero_mean_are_kept() -> None:
    # mean 0, as often with {-1, +1}: a "0 < mean < 1" test would drop it.
    keep = zero_variance_mask(rewards=torch.tensor([[-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]]))
    assert keep.tolist() == [True, True, False]


def test_group_advantages_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_prompts, group_size"):
        group_advantages(rewards=torch.zeros(4))
    with pytest.raises(ValueError, match="normalization"):
        group_advantages(rewards=torch.tensor([[0.0, 1.0]]), normalization="whiten")  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# CISPO and aggregation
# --------------------------------------------------------------------------


def test_cispo_by_hand() -> None:
    """One prompt, rewards [1, 0] -> A = [0.5, -0.5]; rho = 1 so w = 1."""
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    advantages = torch.tensor([0.5, -0.5], dtype=torch.float64)
    prompt_index = torch.tensor([0, 0])
    loss, stats = cispo_loss(
        logp=logp, logp_gen=logp.detach(), advantages=advantages, mask=mask, prompt_index=prompt_index
    )
    # -(0.5 * (-1) + 0.5 * (-2) - 0.5 * (-1)) / 3 tokens
    torch.testing.assert_close(loss, torch.tensor(1.0 / 3.0, dtype=torch.float64))
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 6, -1 / 6], [1 / 6, 0.0]], dtype=torch.float64))
    assert stats == {"is/capped_frac": 0.0, "is/rho_max": 1.0, "is/rho_min": 1.0}


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("reward_kind", get_args(RewardKind))
def test_cispo_matches_reference(
    normalization: Normalization, aggregation: Aggregation, reward_kind: RewardKind
) -> None:
    batch = random_batch(seed=11, num_prompts=5, group_size=4, num_tokens=6, reward_kind=reward_kind)
    assert_matches_reference(batch, normalization, aggregation, eps_max=4.0)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_prompts=st.integers(1, 4),
    group_size=st.integers(2, 4),
    num_tokens=st.integers(1, 6),
    reward_kind=st.sampled_from(get_args(RewardKind)),
    normalization=st.sampled_from(NORMALIZATIONS),
    aggregation=st.sampled_from(AGGREGATIONS),
    eps_max=st.sampled_from([1.0, 2.0, 4.0, 8.0]),
)
def test_cispo_matches_reference_random_shapes(
    seed: int,
    num_prompts: int,
    group_size: int,
    num_tokens: int,
    reward_kind: RewardKind,
    normalization: Normalization,
    aggregation: Aggregation,
    eps_max: float,
) -> None:
    batch = random_batch(seed, num_prompts, group_size, num_tokens, reward_kind)
    assert_matches_reference(batch, normalization, aggregation, eps_max)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_one_token_completions(aggregation: Aggregation) -> None:
    batch = random_batch(seed=3, num_prompts=3, group_size=4, num_tokens=1, reward_kind="binary", zero_variance_prob=0)
    assert all(len(row) == 1 for row in batch.mask)
    assert_matches_reference(batch, "batch", aggregation, eps_max=4.0)


def test_capped_weights() -> None:
    """rho > eps_max: the weight is eps_max, the gradient -eps_max * A, and the cap is counted."""
    logp = torch.tensor([[-0.5, -0.5, -0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    # rho = e^3, e^1, e^0, e^-1: one above eps_max = 4 (e^1.386...).
    logp_gen = logp.detach() - torch.tensor([[3.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    advantages = torch.tensor([2.0], dtype=torch.float64)
    mask = torch.ones_like(logp_gen)
    loss, stats = cispo_loss(
        logp=logp,
        logp_gen=logp_gen,
        advantages=advantages,
        mask=mask,
        prompt_index=torch.tensor([0]),
        eps_max=4.0,
        aggregation="token",
    )
    weights = torch.tensor([4.0, math.e, 1.0, math.exp(-1.0)], dtype=torch.float64)
    torch.testing.assert_close(loss, (-weights * 2.0 * -0.5).mean())
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad[0], -weights * 2.0 / 4)
    assert stats["is/capped_frac"] == pytest.approx(0.25)
    assert stats["is/rho_max"] == pytest.approx(math.exp(3.0))
    assert stats["is/rho_min"] == pytest.approx(math.exp(-1.0))


def test_log_ratio_clamp_keeps_loss_finite() -> None:
    """A numerically broken token (|logp - logp_gen| ~ 1e4) must not give inf/NaN."""
    logp = torch.tensor([[-0.1, -1e4], [-0.2, -0.3]], requires_grad=True)  # float32, as in training
    logp_gen = torch.tensor([[-1e4, -0.1], [-0.2, -0.3]])
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2)
    for aggregation in AGGREGATIONS:
        loss, stats = cispo_loss(
            logp=logp,
            logp_gen=logp_gen,
            advantages=advantages,
            mask=mask,
            prompt_index=torch.tensor([0, 0]),
            aggregation=aggregation,
        )
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss)
        assert torch.isfinite(grad).all()
        assert stats["is/rho_max"] == pytest.approx(math.exp(LOG_RATIO_CLAMP), rel=1e-5)
        assert stats["is/rho_min"] == pytest.approx(math.exp(-LOG_RATIO_CLAMP), rel=1e-5)
        assert stats["is/capped_frac"] == pytest.approx(0.25)
    # The clamped-low token's weight is e^-20: its gradient is -e^-20 * A / count, not 0 and not inf.
    loss, _ = cispo_loss(
        logp=logp,
        logp_gen=logp_gen,
        advantages=advantages,
        mask=mask,
        prompt_index=torch.tensor([0, 0]),
        aggregation="token",
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 1].item() == pytest.approx(-math.exp(-LOG_RATIO_CLAMP) / 4, rel=1e-4)
    assert grad[0, 0].item() == pytest.approx(-4.0 / 4)


def test_masked_tokens_get_no_gradient_and_do_not_count() -> None:
    """Injected (mask 0) and padding tokens: zero gradient, not in any denominator."""
    batch = random_batch(seed=5, num_prompts=3, group_size=3, num_tokens=5, reward_kind="binary", zero_variance_prob=0)
    for aggregation in AGGREGATIONS:
        loss, grad, _, _ = run_recipe(batch, "batch", aggregation, eps_max=4.0)
        mask = torch.tensor(batch.mask, dtype=torch.bool)
        assert (~mask).any() and mask.any()
        assert grad[~mask].abs().sum() == 0
        # Changing what sits under the mask changes nothing.
        noisy = Batch(
            batch.rewards,
            [[v if m else -50.0 for v, m in zip(r, mr)] for r, mr in zip(batch.logp, batch.mask)],
            [[v if m else 3.0 for v, m in zip(r, mr)] for r, mr in zip(batch.logp_gen, batch.mask)],
            batch.mask,
            batch.prompt_index,
        )
        loss2, grad2, _, _ = run_recipe(noisy, "batch", aggregation, eps_max=4.0)
        torch.testing.assert_close(loss2, loss)
        torch.testing.assert_close(grad2, grad)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_zero_variance_prompt_contributes_nothing(aggregation: Aggregation) -> None:
    """Adding a zero-variance prompt changes neither the loss nor the other prompts' gradients."""
    base = random_batch(seed=21, num_prompts=3, group_size=4, num_tokens=4, reward_kind="signed", zero_variance_prob=0)
    extra = random_batch(seed=22, num_prompts=1, group_size=4, num_tokens=4, reward_kind="signed", zero_variance_prob=1)
    assert len(set(extra.rewards[0])) == 1
    combined = Batch(
        base.rewards + extra.rewards,
        base.logp + extra.logp,
        base.logp_gen + extra.logp_gen,
        base.mask + extra.mask,
        base.prompt_index + [3] * 4,
    )
    loss, grad, _, _ = run_recipe(base, "batch", aggregation, eps_max=4.0)
    loss_c, grad_c, _, keep = run_recipe(combined, "batch", aggregation, eps_max=4.0)
    assert keep.tolist() == [True, True, True, False]
    torch.testing.assert_close(loss_c, loss, **TOL)
    torch.testing.assert_close(grad_c[: len(base.mask)], grad, **TOL)
    assert grad_c[len(base.mask) :].abs().sum() == 0
    # Even left in the mask, its zero advantages give it no gradient.
    rewards, logp, logp_gen, mask, prompt_index = combined.tensors()
    advantages, _ = group_advantages(rewards=rewards)
    loss_u, _ = cispo_loss(
        logp=logp,
        logp_gen=logp_gen,
        advantages=advantages.reshape(-1),
        mask=mask,
        prompt_index=prompt_index,
        aggregation=aggregation,
    )
    (grad_u,) = torch.autograd.grad(loss_u, logp)
    assert grad_u[len(base.mask) :].abs().sum() == 0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("drop_from_mask", [False, True])
def test_all_prompts_zero_variance(aggregation: Aggregation, drop_from_mask: bool) -> None:
    """Nothing to learn: the loss is finite (0) and the gradient exactly zero."""
    batch = random_batch(seed=9, num_prompts=3, group_size=3, num_tokens=4, reward_kind="signed", zero_variance_prob=1)
    rewards, logp, logp_gen, mask, prompt_index = batch.tensors()
    advantages, keep = group_advantages(rewards=rewards)
    assert not keep.any()
    if drop_from_mask:
        mask = mask * keep[prompt_index, None]
    loss, stats = cispo_loss(
        logp=logp,
        logp_gen=logp_gen,
        advantages=advantages.reshape(-1),
        mask=mask,
        prompt_index=prompt_index,
        aggregation=aggregation,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and loss.item() == 0.0
    assert grad.abs().sum() == 0
    if drop_from_mask:
        assert stats == {"is/capped_frac": 0.0, "is/rho_max": 1.0, "is/rho_min": 1.0}


def test_aggregations_by_hand() -> None:
    """Two prompts with different token counts tell the three aggregations apart."""
    token_loss = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0], [2.0, 2.0, 0.0], [8.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    prompt_index = torch.tensor([0, 0, 1, 1])

    # prompt: (3 + 4) / 4 and (4 + 8) / 3, averaged
    def agg(aggregation: Aggregation) -> float:
        return aggregate(token_loss=token_loss, mask=mask, prompt_index=prompt_index, aggregation=aggregation).item()

    assert agg("prompt") == pytest.approx((7 / 4 + 12 / 3) / 2)
    # sample: completion means 1, 4, 2, 8
    assert agg("sample") == pytest.approx(15 / 4)
    # token: 19 over 7 tokens
    assert agg("token") == pytest.approx(19 / 7)
    with pytest.raises(ValueError, match="aggregation"):
        agg("batch")  # type: ignore[arg-type]


def test_ratio_stats_ignore_masked_tokens() -> None:
    logp = torch.zeros(1, 3)
    logp_gen = torch.tensor([[-1.0, 0.0, -5.0]])  # rho e^1, 1, e^5 (masked)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, stats = cispo_loss(
        logp=logp,
        logp_gen=logp_gen,
        advantages=torch.tensor([1.0]),
        mask=mask,
        prompt_index=torch.tensor([0]),
        eps_max=2.0,
    )
    assert stats["is/capped_frac"] == pytest.approx(0.5)
    assert stats["is/rho_max"] == pytest.approx(math.e, rel=1e-6)
    assert stats["is/rho_min"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("logp_shape", "gen_shape", "mask_shape", "adv_len", "index_len", "match"),
    [
        ((2, 3), (2, 4), (2, 3), 2, 2, "logp, logp_gen and mask"),
        ((2, 3), (2, 3), (3, 3), 2, 2, "logp, logp_gen and mask"),
        ((6,), (6,), (6,), 2, 2, "logp, logp_gen and mask"),
        ((2, 3), (2, 3), (2, 3), 3, 2, "advantages and prompt_index"),
        ((2, 3), (2, 3), (2, 3), 2, 1, "advantages and prompt_index"),
    ],
)
def test_cispo_rejects_mismatched_shapes(
    logp_shape: tuple[int, ...],
    gen_shape: tuple[int, ...],
    mask_shape: tuple[int, ...],
    adv_len: int,
    index_len: int,
    match: str,
) -> None:
    with pytest.raises(ValueError, match=match):
        cispo_loss(
            logp=torch.zeros(logp_shape),
            logp_gen=torch.zeros(gen_shape),
            advantages=torch.zeros(adv_len),
            mask=torch.ones(mask_shape),
            prompt_index=torch.zeros(index_len, dtype=torch.long),
        )


# --------------------------------------------------------------------------
# PPO-style losses: GRPO, DAPO (with and without TIS) and GSPO
# --------------------------------------------------------------------------


def ref_aggregate(
    token_terms: list[list[torch.Tensor]], prompt_index: list[int], aggregation: str, zero: torch.Tensor
) -> torch.Tensor:
    """RECIPE 2 aggregation over per-completion lists of token terms, one at a time."""
    if aggregation == "token":
        terms = [x for row in token_terms for x in row]
        return sum(terms, zero) / len(terms) if terms else zero
    if aggregation == "sample":
        per = [sum(row, zero) / len(row) for row in token_terms if row]
        return sum(per, zero) / len(per) if per else zero
    per_prompt = []
    for p in sorted(set(prompt_index)):
        terms = [x for n, row in enumerate(token_terms) if prompt_index[n] == p for x in row]
        if terms:
            per_prompt.append(sum(terms, zero) / len(terms))
    return sum(per_prompt, zero) / len(per_prompt) if per_prompt else zero


def _clamp(x: float) -> float:
    return min(max(x, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)


def ref_ppo(
    logp: torch.Tensor,
    logp_gen: list[list[float]],
    advantages: list[float],
    mask: list[list[int]],
    prompt_index: list[int],
    eps_low: float,
    eps_high: float,
    aggregation: str,
    tis_cap: float | None,
) -> torch.Tensor:
    """Per token -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) [x sg(min(pi/pi_gen, C))]."""
    terms: list[list[torch.Tensor]] = []
    for n in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            if not mask[n][t]:
                continue
            if tis_cap is None:
                r = torch.exp(torch.clamp(logp[n, t] - logp_gen[n][t], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
                w = 1.0
            else:
                old = float(logp[n, t].detach())  # the learner's own log-prob, held fixed
                r = torch.exp(logp[n, t] - old)  # value 1, gradient of logp
                w = min(math.exp(_clamp(old - logp_gen[n][t])), tis_cap)
            a = advantages[n]
            row.append(-torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a) * w)
        terms.append(row)
    return ref_aggregate(terms, prompt_index, aggregation, logp.sum() * 0.0)


def ref_gspo(
    logp: torch.Tensor,
    logp_gen: list[list[float]],
    advantages: list[float],
    mask: list[list[int]],
    prompt_index: list[int],
    eps_low: float,
    eps_high: float,
    aggregation: str,
) -> torch.Tensor:
    """s_i = exp(mean of token log-ratios); -min(s A, clip(s) A) on each of the sequence's tokens."""
    terms: list[list[torch.Tensor]] = []
    for n in range(logp.shape[0]):
        tokens = [t for t in range(logp.shape[1]) if mask[n][t]]
        if not tokens:
            terms.append([])
            continue
        diffs = [torch.clamp(logp[n, t] - logp_gen[n][t], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) for t in tokens]
        s = torch.exp(sum(diffs, logp.sum() * 0.0) / len(tokens))
        a = advantages[n]
        seq = -torch.minimum(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a)
        terms.append([seq] * len(tokens))
    return ref_aggregate(terms, prompt_index, aggregation, logp.sum() * 0.0)


PPO_CASES = [("grpo", None), ("dapo", None), ("grpo", 2.0), ("dapo", 2.0), ("gspo", None)]


def assert_ppo_matches_reference(
    batch: Batch, name: str, tis_cap: float | None, normalization: Normalization, aggregation: Aggregation
) -> None:
    from services.learner.config import LossSettings
    from services.learner.losses import policy_loss

    settings = LossSettings(name=name, tis_cap=tis_cap, aggregation=aggregation, normalization=normalization)
    low, high = settings.clip
    rewards, logp, logp_gen, mask, prompt_index = batch.tensors()
    advantages, keep = group_advantages(rewards=rewards, normalization=normalization)
    loss, _ = policy_loss(
        name=name,
        logp=logp,
        logp_gen=logp_gen,
        advantages=advantages.reshape(-1),
        mask=mask * keep[prompt_index, None],
        prompt_index=prompt_index,
        aggregation=aggregation,
        clip=(low, high),
        tis_cap=tis_cap,
    )
    (grad,) = torch.autograd.grad(loss, logp)

    ref_adv, ref_keep = ref_advantages(batch.rewards, normalization)
    per = [ref_adv[p][i] for p in range(batch.num_prompts) for i in range(len(batch.rewards[p]))]
    ref_mask = [[m if ref_keep[p] else 0 for m in row] for row, p in zip(batch.mask, batch.prompt_index)]
    ref_logp = torch.tensor(batch.logp, dtype=torch.float64, requires_grad=True)
    if name == "gspo":
        ref = ref_gspo(ref_logp, batch.logp_gen, per, ref_mask, batch.prompt_index, low, high, aggregation)
    else:
        ref = ref_ppo(ref_logp, batch.logp_gen, per, ref_mask, batch.prompt_index, low, high, aggregation, tis_cap)
    ref_grad = torch.autograd.grad(ref, ref_logp)[0] if ref.requires_grad else torch.zeros_like(ref_logp)
    torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)


@pytest.mark.parametrize(("name", "tis_cap"), PPO_CASES)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("reward_kind", ["binary", "signed"])
def test_ppo_style_losses_match_reference(
    name: str, tis_cap: float | None, normalization: Normalization, aggregation: Aggregation, reward_kind: RewardKind
) -> None:
    batch = random_batch(seed=23, num_prompts=5, group_size=4, num_tokens=6, reward_kind=reward_kind)
    assert_ppo_matches_reference(batch, name, tis_cap, normalization, aggregation)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    case=st.sampled_from(PPO_CASES),
    num_tokens=st.integers(1, 5),
    normalization=st.sampled_from(NORMALIZATIONS),
    aggregation=st.sampled_from(AGGREGATIONS),
    reward_kind=st.sampled_from(get_args(RewardKind)),
)
def test_ppo_style_losses_match_reference_random_shapes(
    seed: int,
    case: tuple[str, float | None],
    num_tokens: int,
    normalization: Normalization,
    aggregation: Aggregation,
    reward_kind: RewardKind,
) -> None:
    batch = random_batch(seed, 3, 3, num_tokens, reward_kind)
    assert_ppo_matches_reference(batch, case[0], case[1], normalization, aggregation)


def test_ppo_clip_by_hand() -> None:
    from services.learner.losses import ppo_clip_loss

    # One token each: r = 1.5 with A = +1 is clipped at 1.2 (no gradient);
    # r = 0.5 with A = +1 is not clipped (gradient -r); mean over the two.
    logp = torch.tensor([[math.log(1.5)], [math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    loss, stats = ppo_clip_loss(
        logp=logp,
        logp_gen=torch.zeros(2, 1, dtype=torch.float64),
        advantages=torch.tensor([1.0, 1.0], dtype=torch.float64),
        mask=torch.ones(2, 1),
        prompt_index=torch.tensor([0, 1]),
        eps_low=0.2,
        eps_high=0.2,
        aggregation="sample",
    )
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0], [-0.25]], dtype=torch.float64))
    assert stats["is/capped_frac"] == pytest.approx(0.5)


def test_tis_needs_a_ppo_loss() -> None:
    from pydantic import ValidationError

    from services.learner.config import LossSettings

    with pytest.raises(ValidationError, match="tis_cap applies to grpo and dapo"):
        LossSettings(name="cispo", tis_cap=2.0)


def test_public_functions_take_keyword_arguments_only() -> None:
    """Several tensors share one shape; naming each at the call keeps them from being swapped."""
    import inspect

    from services.learner import losses

    public = [
        f
        for name, f in vars(losses).items()
        if inspect.isfunction(f) and not name.startswith("_") and f.__module__ == losses.__name__
    ]
    assert len(public) >= 10
    for f in public:
        kinds = {p.kind for p in inspect.signature(f).parameters.values()}
        assert kinds == {inspect.Parameter.KEYWORD_ONLY}, f.__name__


@pytest.mark.parametrize("name", ["grpo", "dapo"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_tis_capped_fraction_counts_weights_over_the_cap(name: str, aggregation: Aggregation) -> None:
    """With TIS the capped fraction is the share of loss tokens whose weight pi_learner / pi_gen exceeded
    tis_cap; the PPO clip against the learner's own log-probs cannot bind, so it was read as 0 before."""
    from services.learner.losses import policy_loss

    batch = random_batch(seed=31, num_prompts=4, group_size=3, num_tokens=5, reward_kind="binary")
    rewards, logp, logp_gen, mask, prompt_index = batch.tensors()
    advantages, keep = group_advantages(rewards=rewards)
    loss_mask = mask * keep[prompt_index, None]
    _, stats = policy_loss(
        name=name,
        logp=logp,
        logp_gen=logp_gen,
        advantages=advantages.reshape(-1),
        mask=loss_mask,
        prompt_index=prompt_index,
        aggregation=aggregation,
        tis_cap=2.0,
    )
    weights = [
        math.exp(_clamp(batch.logp[n][t] - batch.logp_gen[n][t]))
        for n in range(len(batch.logp))
        for t in range(len(batch.logp[n]))
        if loss_mask[n, t]
    ]
    capped = sum(1 for w in weights if w > 2.0)
    assert 0 < capped < len(weights)
    assert stats["is/capped_frac"] == pytest.approx(capped / len(weights), rel=1e-6)
    assert stats["is/rho_max"] == pytest.approx(max(weights), rel=1e-9)
    assert stats["is/rho_min"] == pytest.approx(min(weights), rel=1e-9)


def test_gspo_says_when_its_aggregation_weighs_by_length() -> None:
    from services.learner.config import LossSettings

    for aggregation in ("prompt", "token"):
        (warning,) = LossSettings(name="gspo", aggregation=aggregation).warnings()
        assert f"aggregation {aggregation!r}" in warning and "length-weighted" in warning
    assert LossSettings(name="gspo", aggregation="sample").warnings() == []
    assert LossSettings(name="cispo").warnings() == []
