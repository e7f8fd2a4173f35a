"""One learner step: rollout groups in, an optimizer step and metrics out.

Owns turning a batch of ``RolloutGroup`` messages into padded tensors
(never re-tokenising: the generator's token ids are used as they are), the
forward pass (``model.PolicyForward``: FP32 LM head), the loss call, the
optimizer and scheduler, and the step metrics of RECIPE.md section 4. Knows nothing about
gRPC or NATS.
"""

from __future__ import annotations

import gc
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from asymptote.contracts.v1 import rollout_pb2, services_pb2
from asymptote.errors import PayloadError
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.distributed import DataParallel
from services.learner.losses import aggregation_weights, batch_counts, group_advantages, log_ratio, policy_loss
from services.learner.model import CPU_FP32, PackedBatch, PolicyForward, Precision, pack


@dataclass(frozen=True)
class StepInputs:
    batch: PackedBatch
    logp_gen: torch.Tensor  # [N, T] generator log-probs (0 on padding)
    loss_mask: torch.Tensor  # [N, T] 1 where the token is in the loss
    token_versions: torch.Tensor  # [N, T] policy version that sampled each token
    rewards: torch.Tensor  # [P, G]
    prompt_index: torch.Tensor  # [N]
    temperature: torch.Tensor  # [N]
    truncated: torch.Tensor  # [N] bool
    num_prompts: int
    num_taken: int  # groups the step consumed: num_prompts, plus the flat ones the broker dropped to refill it
    keep_zero_variance: bool  # flat groups count in the loss's denominators (the broker's zero_variance: keep)


def collate(
    groups: Sequence[rollout_pb2.RolloutGroup], pad_id: int, header: services_pb2.BatchHeader | None = None
) -> StepInputs:
    """Lay out a batch of groups; raises PayloadError on inconsistent groups.

    ``header``: the broker's for the batch, which says how many groups the
    step took and whether flat groups count in the loss (None: a batch
    assembled here, every group taken, flat ones left out).
    """
    if not groups:
        raise PayloadError("empty batch")
    group_size = len(groups[0].completions)
    prompts: list[list[int]] = []
    completions: list[list[int]] = []
    rows_gen: list[list[float]] = []
    rows_mask: list[list[int]] = []
    rows_version: list[list[int]] = []
    rewards: list[list[float]] = []
    prompt_index: list[int] = []
    temperature: list[float] = []
    truncated: list[bool] = []
    for p, g in enumerate(groups):
        if len(g.completions) != group_size:
            raise PayloadError(f"group {g.group_id} has {len(g.completions)} completions, the batch has {group_size}")
        rewards.append([c.reward for c in g.completions])
        for c in g.completions:
            n = len(c.token_ids)
            prompts.append(list(g.prompt_token_ids))
            completions.append(list(c.token_ids))
            rows_gen.append(list(c.logprobs))
            rows_mask.append(list(c.loss_mask) if c.loss_mask else [1] * n)
            versions = [0] * n
            for span in c.version_spans:
                versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
            rows_version.append(versions)
            prompt_index.append(p)
            temperature.append(g.task.sampling.temperature or 1.0)
            truncated.append(c.truncated)
    batch = pack(prompts, completions, pad_id)
    width = batch.completion_mask.shape[1]
    return StepInputs(
        batch=batch,
        logp_gen=_rows(rows_gen, width, torch.float32),
        loss_mask=_rows(rows_mask, width, torch.float32) * batch.completion_mask,
        token_versions=_rows(rows_version, width, torch.long),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        prompt_index=torch.tensor(prompt_index, dtype=torch.long),
        temperature=torch.tensor(temperature, dtype=torch.float32),
        truncated=torch.tensor(truncated, dtype=torch.bool),
        num_prompts=len(groups),
        num_taken=len(groups) if header is None else header.num_groups + header.num_zero_variance,
        keep_zero_variance=header is not None and header.keep_zero_variance,
    )


def _rows(rows: Sequence[Sequence[float]], width: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def select_rows(batch: PackedBatch, rows: torch.Tensor) -> PackedBatch:
    """The completions ``rows`` of a packed batch, padding unchanged."""
    return PackedBatch(
        input_ids=batch.input_ids[rows],
        attention_mask=batch.attention_mask[rows],
        position_ids=batch.position_ids[rows],
        prompt_len=batch.prompt_len,
        completion_mask=batch.completion_mask[rows],
    )


class Trainer:
    """Optimizer steps on whole batches, over one process or the ranks of ``dp``.

    Every rank holds the whole batch; advantages, the keep mask and the
    aggregation weights come from all of it, and each rank differentiates
    only its share of the prompts (``DataParallel.prompt_range``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        loss: LossSettings,
        opt: OptimizerSettings,
        dp: DataParallel | None = None,
        precision: Precision = CPU_FP32,
    ) -> None:
        self.model = model
        self.precision = precision
        self.dp = dp or DataParallel()
        self.policy = self.dp.wrap(PolicyForward(model, precision))
        self._released = False
        self.loss_settings = loss
        self.opt_settings = opt
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        warmup = max(opt.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)) if warmup else 1.0
        )

    # -- data parallelism: rank 0 leads, the other ranks follow ---------------

    def sync_from_main(self) -> None:
        """Every rank takes rank 0's weights, optimizer and scheduler state (after rank 0 resumed)."""
        if not self.dp.distributed:
            return
        state = self.dp.broadcast(
            (self.model.state_dict(), self.optimizer.state_dict(), self.scheduler.state_dict())
            if self.dp.is_main
            else None
        )
        if not self.dp.is_main:
            model_state, opt_state, sched_state = state
            self.model.load_state_dict(model_state)
            self.optimizer.load_state_dict(opt_state)
            self.scheduler.load_state_dict(sched_state)

    def follow(self) -> int:
        """Ranks > 0: step on each batch rank 0 broadcasts until it releases them; returns steps taken."""
        steps = 0
        while (message := self.dp.broadcast(None)) is not None:
            inputs, learner_version = message
            self._step(inputs, learner_version)
            steps += 1
        return steps

    def release_followers(self) -> None:
        """Rank 0: tell the other ranks there are no more steps."""
        if self.dp.distributed and self.dp.is_main and not self._released:
            self.dp.broadcast(None)
            self._released = True

    def close(self) -> None:
        """Drop the DDP wrapper: it must be gone before the process group is destroyed."""
        self.policy = PolicyForward(self.model, self.precision)
        gc.collect()

    def step(self, inputs: StepInputs, learner_version: int) -> dict[str, float]:
        """One optimizer step on ``inputs`` (rank 0 hands them to the other ranks); returns the step's metrics."""
        if self.dp.distributed:
            self.dp.broadcast((inputs, learner_version))
        return self._step(inputs, learner_version)

    def _step(self, inputs: StepInputs, learner_version: int) -> dict[str, float]:
        started = time.perf_counter()
        s = self.loss_settings
        self.model.train()
        advantages, keep = group_advantages(
            rewards=inputs.rewards, normalization=s.normalization, keep_zero_variance=inputs.keep_zero_variance
        )
        per_completion_adv = advantages.reshape(-1)
        # Prompts not kept (flat ones, unless the batch keeps them) are out of
        # the loss (RECIPE 1): masking their tokens keeps them out of the
        # aggregation's denominators too.
        loss_mask = inputs.loss_mask * keep[inputs.prompt_index, None].to(inputs.loss_mask.dtype)
        weights = aggregation_weights(mask=loss_mask, prompt_index=inputs.prompt_index, aggregation=s.aggregation)
        counts = batch_counts(rewards=inputs.rewards, keep=keep, loss_mask=loss_mask, num_taken=inputs.num_taken)
        score_mask = inputs.loss_mask
        batch, temperature, logp_gen = inputs.batch, inputs.temperature, inputs.logp_gen
        if self.dp.distributed:
            first, last = self.dp.prompt_range(inputs.num_prompts)
            rows = ((inputs.prompt_index >= first) & (inputs.prompt_index < last)).nonzero().squeeze(1)
            live = 1.0
            if rows.numel() == 0:
                # More ranks than prompts: score one row with zero weight so that
                # this rank still joins the gradient all-reduce.
                rows, live = rows.new_zeros(1), 0.0
            batch, temperature, logp_gen = select_rows(batch, rows), temperature[rows], logp_gen[rows]
            per_completion_adv, weights = per_completion_adv[rows], weights[rows] * live
            loss_mask, score_mask = loss_mask[rows] * live, score_mask[rows] * live
            prompt_index = inputs.prompt_index[rows]
        else:
            prompt_index = inputs.prompt_index
        logp, entropy = self.policy(batch, temperature)
        # Everything the loss and the scores read lives where the model does.
        device = logp.device
        logp_gen, per_completion_adv, weights = logp_gen.to(device), per_completion_adv.to(device), weights.to(device)
        loss_mask, score_mask, prompt_index = loss_mask.to(device), score_mask.to(device), prompt_index.to(device)
        loss, stats = policy_loss(
            name=s.name,
            logp=logp,
            logp_gen=logp_gen,
            advantages=per_completion_adv,
            mask=loss_mask,
            prompt_index=prompt_index,
            aggregation=s.aggregation,
            eps_max=s.eps_max,
            clip=s.clip,
            tis_cap=s.tis_cap,
            weights=weights,
        )
        self.optimizer.zero_grad(set_to_none=True)
        if keep.any():
            # DDP averages gradients over ranks; the batch's loss is the sum of the shards'.
            (loss * self.dp.world_size).backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.opt_settings.max_grad_norm))
            if math.isfinite(grad_norm):
                self.optimizer.step()
            self.scheduler.step()
        else:
            grad_norm = 0.0
        compute_s = time.perf_counter() - started

        scored = self._scored_stats(loss, logp, logp_gen, entropy, score_mask, loss_mask, stats)
        mask = inputs.loss_mask.bool()
        num_tokens = int(inputs.batch.completion_mask.sum())
        staleness = (learner_version - inputs.token_versions)[mask]
        hist = Counter(int(x) for x in staleness.tolist())
        metrics = {
            "reward/mean": float(inputs.rewards.mean()),
            "reward/pass_rate": float((inputs.rewards > 0).float().mean()),
            "batch/prompts": float(inputs.num_prompts),
            **counts,
            "batch/samples": float(inputs.rewards.numel()),
            "batch/tokens": float(num_tokens),
            "batch/truncation_rate": float(inputs.truncated.float().mean()),
            "optim/grad_norm": grad_norm,
            "dist/ranks": float(self.dp.world_size),
            "optim/lr": float(self.scheduler.get_last_lr()[0]),
            "time/compute_s": compute_s,
            "perf/tokens_per_s": num_tokens / compute_s if compute_s > 0 else 0.0,
            "perf/samples_per_s": inputs.rewards.numel() / compute_s if compute_s > 0 else 0.0,
            "batch/min_token_version": float(inputs.token_versions[mask].min()) if mask.any() else 0.0,
            "batch/max_token_version": float(inputs.token_versions[mask].max()) if mask.any() else 0.0,
            "staleness/mean": float(staleness.float().mean()) if staleness.numel() else 0.0,
            "staleness/max": float(staleness.max()) if staleness.numel() else 0.0,
            **{f"staleness/hist/{k}": float(v) for k, v in sorted(hist.items())},
            **scored,
        }
        return metrics

    def _scored_stats(
        self,
        loss: torch.Tensor,
        logp: torch.Tensor,
        logp_gen: torch.Tensor,
        entropy: torch.Tensor,
        score_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        stats: dict[str, float],
    ) -> dict[str, float]:
        """Metrics of the learner's own scores, summed over ranks (one process: as they are)."""
        mask = score_mask.bool()
        with torch.no_grad():
            diff = log_ratio(logp=logp.detach(), logp_gen=logp_gen)[mask]
            # k3 estimator of KL(gen || learner): E_gen[exp(d) - 1 - d], d = logp - logp_gen.
            kl = diff.exp() - 1 - diff
            in_loss = float(loss_mask.sum())
            present = in_loss > 0
            sums = self.dp.sum(
                torch.tensor(
                    [
                        float(loss.detach()),
                        float(entropy[mask].sum()),
                        float(mask.sum()),
                        float(kl.sum()),
                        float(diff.abs().sum()),
                        stats["is/capped_frac"] * in_loss,
                        in_loss,
                    ],
                    dtype=torch.float64,
                )
            )
            extremes = self.dp.max(
                torch.tensor(
                    [
                        stats["is/rho_max"] if present else -math.inf,
                        -stats["is/rho_min"] if present else -math.inf,
                    ],
                    dtype=torch.float64,
                )
            )
        loss_sum, entropy_sum, scored, kl_sum, abs_sum, capped, in_loss_total = sums.tolist()
        some = in_loss_total > 0
        return {
            "loss": loss_sum,
            "policy/entropy": entropy_sum / scored if scored else 0.0,
            "is/mean_abs_logp_diff": abs_sum / scored if scored else 0.0,
            "is/kl_gen_learner": kl_sum / scored if scored else 0.0,
            "is/capped_frac": capped / in_loss_total if some else 0.0,
            "is/rho_max": float(extremes[0]) if some else 1.0,
            "is/rho_min": -float(extremes[1]) if some else 1.0,
        }
