"""RL losses and advantages as small pure functions.

Owns the maths of docs/recipe.md ("Advantages", "Losses"): group-centred advantages with
their normalisation, the zero-variance mask, and the policy-gradient losses
with their token aggregation. Knows nothing about batching, models or the
wire: inputs are padded tensors, outputs a scalar loss and float metrics.

Shapes used throughout:
  N completions, padded to T tokens; ``mask[n, t]`` is 1 where token t of
  completion n is in the loss (real, not padding, not injected);
  ``prompt_index[n]`` in [0, P) says which prompt group completion n belongs
  to; ``advantages[n]`` is that completion's advantage. A prompt dropped by
  the zero-variance filter has mask 0 on all its tokens (the caller applies
  the keep mask), so it is in no denominator of the aggregation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["prompt", "sample", "token"]
Normalization = Literal["batch", "group", "none"]

# exp() of a log-ratio beyond +-20 overflows float32 usefulness (e^20 ~ 5e8)
# and only arises from numerically broken tokens; clamping keeps one bad
# token from producing inf/NaN gradients for the whole batch.
LOG_RATIO_CLAMP = 20.0

_STD_FLOOR = 1e-8


def zero_variance_mask(*, rewards: torch.Tensor) -> torch.Tensor:
    """[P, G] rewards -> [P] bool, True where the group's rewards are not all equal.

    Tests "all equal" rather than "0 < mean < 1" so {-1, +1} rewards work.
    """
    return (rewards != rewards[:, :1]).any(dim=1)


def group_advantages(
    *, rewards: torch.Tensor, normalization: Normalization = "batch", keep_zero_variance: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-centred advantages ``A_i = r_i - mean_j r_j`` (ScaleRL; docs/recipe.md, "Advantages").

    ``normalization``: "batch" divides by the std of all advantages of the
    kept prompts (ScaleRL default), "group" by each group's own std (GRPO),
    "none" leaves them centred (Dr. GRPO). ``keep_zero_variance``: flat
    groups are kept too (the "no filtering" ablation): their advantages are
    0, and they count in the batch std and, through the keep mask, in the
    loss's denominators. Returns ([P, G] advantages with zero rows for
    zero-variance prompts, [P] keep mask: the prompts in the loss).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_prompts, group_size], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64) if rewards.dtype == torch.float64 else rewards.float()
    keep = zero_variance_mask(rewards=rewards)
    if keep_zero_variance:
        keep = torch.ones_like(keep)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if normalization == "batch":
        kept = centred[keep]
        # A std of zero only happens when no prompt is kept; the floor keeps
        # the division finite and the (all-zero) advantages unchanged.
        std = kept.std(unbiased=False) if kept.numel() > 1 else centred.new_tensor(1.0)
        centred = centred / std.clamp_min(_STD_FLOOR)
    elif normalization == "group":
        std = centred.std(dim=1, unbiased=False, keepdim=True)
        centred = centred / std.clamp_min(_STD_FLOOR)
    elif normalization != "none":
        raise ValueError(f"normalization must be 'batch', 'group' or 'none', got {normalization!r}")
    return centred * keep[:, None], keep


def aggregation_weights(
    *,
    mask: torch.Tensor,
    prompt_index: torch.Tensor,
    aggregation: Aggregation = "prompt",
) -> torch.Tensor:
    """[N, T] weight of each token's loss in the batch's scalar loss (docs/recipe.md, "Losses").

    Every aggregation is a weighted sum ``sum_{n,t} w[n,t] * loss[n,t]`` whose
    weights depend only on the mask and the prompt layout, never on the
    parameters. "prompt": 1 / (the prompt's loss tokens * prompts with loss
    tokens), ScaleRL's default. "sample": 1 / (the completion's loss tokens *
    completions with loss tokens). "token": 1 / (all loss tokens). Computing
    them once on the whole batch is what lets data-parallel ranks each sum
    their own rows and still add up to the one-process loss.
    """
    mask = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.float32)
    if aggregation == "token":
        return mask / mask.sum().clamp_min(1.0)
    if aggregation == "sample":
        counts = mask.sum(dim=1)
        present = (counts > 0).sum().clamp_min(1)
        return mask / (counts.clamp_min(1.0) * present)[:, None]
    if aggregation == "prompt":
        num_prompts = int(prompt_index.max().item()) + 1 if prompt_index.numel() else 0
        counts = mask.new_zeros(num_prompts).index_add(0, prompt_index, mask.sum(dim=1))
        present = (counts > 0).sum().clamp_min(1)
        return mask / (counts.clamp_min(1.0)[prompt_index] * present)[:, None]
    raise ValueError(f"aggregation must be 'prompt', 'sample' or 'token', got {aggregation!r}")


def aggregate(
    *,
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    prompt_index: torch.Tensor,
    aggregation: Aggregation = "prompt",
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce masked per-token losses [N, T] to a scalar (docs/recipe.md, "Losses").

    "prompt": per prompt, sum over all its completions' tokens divided by the
    prompt's token count, then mean over prompts with loss tokens (ScaleRL
    default). "sample": mean over tokens of each completion, then mean over
    completions with loss tokens. "token": mean over all loss tokens of the
    batch. With no loss token at all the result is 0 (and so is its gradient).
    ``weights``: this shard's rows of ``aggregation_weights`` of the whole
    batch (data-parallel ranks); the result is then this shard's part of the
    whole batch's loss.
    """
    if weights is None:
        weights = aggregation_weights(
            mask=mask.to(token_loss.dtype), prompt_index=prompt_index, aggregation=aggregation
        )
    elif weights.shape != token_loss.shape:
        raise ValueError(f"weights must be {tuple(token_loss.shape)}, got {tuple(weights.shape)}")
    return (token_loss * weights.to(token_loss.dtype)).sum()


def batch_counts(
    *, rewards: torch.Tensor, keep: torch.Tensor, loss_mask: torch.Tensor, num_taken: int
) -> dict[str, float]:
    """What a step's batch semantics made of its prompts (step metrics).

    ``rewards`` [P, G], ``keep`` [P] the prompts in the loss, ``loss_mask``
    [N, T] with the keep mask applied. ``batch/prompts_taken``: groups the
    step consumed (``num_taken``: P, more when the broker dropped flat
    groups to refill the batch); ``batch/kept_prompts``: prompts in the
    loss's denominators; ``batch/effective_prompts``: the effective batch,
    prompts that carry a gradient (kept and not flat); ``batch/loss_samples``
    and ``batch/loss_tokens``: completions and tokens in the loss.
    """
    informative = zero_variance_mask(rewards=rewards) & keep.bool()
    mask = loss_mask.bool()
    return {
        "batch/prompts_taken": float(num_taken),
        "batch/kept_prompts": float(keep.sum()),
        "batch/effective_prompts": float(informative.sum()),
        "batch/loss_samples": float(mask.any(dim=1).sum()),
        "batch/loss_tokens": float(mask.sum()),
    }


def log_ratio(*, logp: torch.Tensor, logp_gen: torch.Tensor) -> torch.Tensor:
    """Clamped ``logp - logp_gen`` (see LOG_RATIO_CLAMP for why)."""
    return (logp - logp_gen).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def cispo_loss(
    *,
    logp: torch.Tensor,
    logp_gen: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    prompt_index: torch.Tensor,
    eps_max: float = 4.0,
    aggregation: Aggregation = "prompt",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RatioStats]:
    """CISPO (MiniMax-M1, arXiv 2506.13585; ScaleRL arXiv 2510.13786).

    Per token ``-sg(min(rho, eps_max)) * A * logp`` with
    ``rho = exp(logp - logp_gen)`` taken against the generator's log-probs,
    so the truncated importance-sampling correction is folded in.
    ``eps_max`` caps the weight itself (ScaleRL's convention: eps_max = 4
    equals ``1 + eps_high`` with eps_high = 3 in the MiniMax/verl notation).
    """
    _check_shapes(logp=logp, logp_gen=logp_gen, advantages=advantages, mask=mask, prompt_index=prompt_index)
    ratio = torch.exp(log_ratio(logp=logp.detach(), logp_gen=logp_gen))
    weight = ratio.clamp(max=eps_max)
    token_loss = -weight * advantages[:, None] * logp
    loss = aggregate(
        token_loss=token_loss, mask=mask, prompt_index=prompt_index, aggregation=aggregation, weights=weights
    )
    return loss, ratio_stats(ratio=ratio, mask=mask, capped=ratio > eps_max)


def ppo_clip_loss(
    *,
    logp: torch.Tensor,
    logp_gen: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    prompt_index: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    aggregation: Aggregation = "sample",
    tis_cap: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RatioStats]:
    """PPO clip: GRPO (arXiv 2402.03300; eps_low = eps_high = 0.2, sample average)
    and DAPO (arXiv 2503.14476; asymmetric eps 0.2 / 0.28, token average).

    Per token ``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``.
    Without ``tis_cap`` the ratio ``r`` is taken against the generator's
    log-probs (the behaviour policy). With it, truncated importance sampling:
    ``r`` is taken against the learner's own pre-step log-probs and the token
    loss is multiplied by ``sg(min(pi_learner / pi_gen, tis_cap))``.
    """
    _check_shapes(logp=logp, logp_gen=logp_gen, advantages=advantages, mask=mask, prompt_index=prompt_index)
    adv = advantages[:, None]
    if tis_cap is None:
        ratio = torch.exp(log_ratio(logp=logp, logp_gen=logp_gen))
        r = ratio.detach()
        capped = ((adv > 0) & (r > 1.0 + eps_high)) | ((adv < 0) & (r < 1.0 - eps_low))
    else:
        # The PPO ratio is taken against the learner's own pre-step log-probs,
        # which it equals within the step: its clip never binds, and the
        # weight that is capped (the metric) is the truncated IS weight.
        ratio = torch.exp(logp - logp.detach())
        r = torch.exp(log_ratio(logp=logp.detach(), logp_gen=logp_gen))
        capped = r > tis_cap
    token_loss = -torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    if tis_cap is not None:
        token_loss = token_loss * r.clamp(max=tis_cap)
    loss = aggregate(
        token_loss=token_loss, mask=mask, prompt_index=prompt_index, aggregation=aggregation, weights=weights
    )
    return loss, ratio_stats(ratio=r, mask=mask, capped=capped)


def gspo_loss(
    *,
    logp: torch.Tensor,
    logp_gen: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    prompt_index: torch.Tensor,
    eps_low: float = 3e-3,
    eps_high: float = 4e-3,
    aggregation: Aggregation = "sample",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RatioStats]:
    """GSPO (arXiv 2507.18071): a sequence-level ratio.

    ``s_i = exp(mean over loss tokens of (logp - logp_gen))``, per sequence
    ``-min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)``; each
    sequence's loss stands on each of its loss tokens and is then aggregated.
    "sample" gives GSPO's objective, the plain mean over sequences. "prompt"
    and "token" divide by token counts, so each sequence weighs as many times
    as it has loss tokens: a length-weighted GSPO (LossSettings warns).
    """
    _check_shapes(logp=logp, logp_gen=logp_gen, advantages=advantages, mask=mask, prompt_index=prompt_index)
    m = mask.to(logp.dtype)
    counts = m.sum(dim=1)
    mean_diff = (log_ratio(logp=logp, logp_gen=logp_gen) * m).sum(dim=1) / counts.clamp_min(1.0)
    s = torch.exp(mean_diff)
    clipped = s.clamp(1.0 - eps_low, 1.0 + eps_high)
    seq_loss = -torch.minimum(s * advantages, clipped * advantages)
    token_loss = seq_loss[:, None].expand_as(logp)
    loss = aggregate(
        token_loss=token_loss, mask=mask, prompt_index=prompt_index, aggregation=aggregation, weights=weights
    )
    sd = s.detach()[:, None].expand_as(logp)
    adv = advantages[:, None].expand_as(logp)
    active = ((adv > 0) & (sd > 1.0 + eps_high)) | ((adv < 0) & (sd < 1.0 - eps_low))
    return loss, ratio_stats(ratio=sd, mask=mask, capped=active)


@dataclass(frozen=True, eq=False)
class RatioStats(Mapping[str, float]):
    """IS-ratio metrics over loss tokens, kept as tensors where the loss ran.

    Read as a mapping (``is/capped_frac``, ``is/rho_max``, ``is/rho_min``:
    the names of docs/recipe.md, "The learner's step") it gives floats,
    which waits for the device; the trainer adds the tensors up over
    micro-batches instead and reads them once a step.
    With no loss tokens the fraction is 0 and both extremes 1.
    """

    capped: torch.Tensor
    """Loss tokens whose weight was capped (0-dim)."""
    tokens: torch.Tensor
    """Loss tokens (0-dim)."""
    rho_max: torch.Tensor
    """The largest ratio over loss tokens (0-dim; -inf with none)."""
    rho_min: torch.Tensor
    """The smallest (0-dim; +inf with none)."""

    KEYS = ("is/capped_frac", "is/rho_max", "is/rho_min")

    def __getitem__(self, key: str) -> float:
        tokens = float(self.tokens)
        if key == "is/capped_frac":
            return float(self.capped) / tokens if tokens else 0.0
        if key == "is/rho_max":
            return float(self.rho_max) if tokens else 1.0
        if key == "is/rho_min":
            return float(self.rho_min) if tokens else 1.0
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)

    @classmethod
    def merge(cls, parts: list[RatioStats]) -> RatioStats:
        """The stats over all of ``parts``' loss tokens, on the device (no wait)."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            capped=torch.stack([p.capped for p in parts]).sum(),
            tokens=torch.stack([p.tokens for p in parts]).sum(),
            rho_max=torch.stack([p.rho_max for p in parts]).max(),
            rho_min=torch.stack([p.rho_min for p in parts]).min(),
        )


def ratio_stats(*, ratio: torch.Tensor, mask: torch.Tensor, capped: torch.Tensor) -> RatioStats:
    """IS-ratio metrics over loss tokens, computed without waiting for the device."""
    m = mask.bool()
    r = ratio.detach().to(torch.float64)
    return RatioStats(
        capped=(capped & m).sum().to(torch.float64),
        tokens=m.sum().to(torch.float64),
        rho_max=torch.where(m, r, -torch.inf).amax() if m.numel() else r.new_tensor(-torch.inf),
        rho_min=torch.where(m, r, torch.inf).amin() if m.numel() else r.new_tensor(torch.inf),
    )


def _check_shapes(
    *,
    logp: torch.Tensor,
    logp_gen: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    prompt_index: torch.Tensor,
) -> None:
    if logp.ndim != 2 or logp.shape != logp_gen.shape or logp.shape != mask.shape:
        raise ValueError(
            "logp, logp_gen and mask must all be [num_completions, num_tokens]; got "
            f"{tuple(logp.shape)}, {tuple(logp_gen.shape)}, {tuple(mask.shape)}"
        )
    n = logp.shape[0]
    if advantages.shape != (n,) or prompt_index.shape != (n,):
        raise ValueError(
            f"advantages and prompt_index must be [{n}]; got {tuple(advantages.shape)}, {tuple(prompt_index.shape)}"
        )


def policy_loss(
    *,
    name: str,
    logp: torch.Tensor,
    logp_gen: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    prompt_index: torch.Tensor,
    aggregation: Aggregation,
    eps_max: float = 4.0,
    clip: tuple[float, float] = (0.2, 0.2),
    tis_cap: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, RatioStats]:
    """The loss named in the learner's config (``weights``: see ``aggregate``)."""
    if name == "cispo":
        return cispo_loss(
            logp=logp,
            logp_gen=logp_gen,
            advantages=advantages,
            mask=mask,
            prompt_index=prompt_index,
            eps_max=eps_max,
            aggregation=aggregation,
            weights=weights,
        )
    if name in ("grpo", "dapo"):
        return ppo_clip_loss(
            logp=logp,
            logp_gen=logp_gen,
            advantages=advantages,
            mask=mask,
            prompt_index=prompt_index,
            eps_low=clip[0],
            eps_high=clip[1],
            aggregation=aggregation,
            tis_cap=tis_cap,
            weights=weights,
        )
    if name == "gspo":
        return gspo_loss(
            logp=logp,
            logp_gen=logp_gen,
            advantages=advantages,
            mask=mask,
            prompt_index=prompt_index,
            eps_low=clip[0],
            eps_high=clip[1],
            aggregation=aggregation,
            weights=weights,
        )
    raise ValueError(f"unknown loss {name!r}; choose cispo, grpo, dapo or gspo")
