"""Single-process on-policy RL: the feasibility check and the benchmark baseline.

Owns one loop, kept deliberately plain: sample G completions for each of B
train prompts with the transformers model itself (temperature 1, KV cache;
under the task's interruption length control when it has one, by the rules
the generators follow: services/embedded/sampling.py), score them with the
task's verifier, compute group-centred advantages with batch-level
normalisation, take one AdamW step on the CISPO loss with
prompt-level aggregation, repeat; every N steps measure the held-out pass
rate (mean over k samples per prompt at temperature 1). No broker, no
vLLM: this is what "generate with transformers, then one step of the same
loss" costs, and a proof that the recipe moves the tiny model. ``lag_steps``
trains on rollouts a fixed number of updates old, to check that settings
survive the staleness the distributed pipeline allows.

The loss and advantages come from ``services.learner.losses`` so the
baseline and the distributed learner optimise exactly the same objective.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from asymptote.config import Frozen
from asymptote.logs import setup_logging
from asymptote.tasks import ArithmeticSettings, Task, TaskSettings, get_task
from services.embedded.sampling import length_control_of, sample_groups
from services.embedded.warmstart import (
    encode_prompts,
    evaluate_pass_rate,
    format_for,
    max_new_tokens_for,
    prepare_model,
)
from services.learner.losses import cispo_loss, group_advantages
from services.learner.model import Samples, completion_logprobs, load_model, load_tokenizer, pack

log = logging.getLogger(__name__)


class OnPolicySettings(Frozen):
    """The on-policy loop; defaults are the tuned values for the tiny model."""

    task: TaskSettings = Field(default_factory=ArithmeticSettings)
    """Task the model was warm-started on (problems and verifier)."""
    num_steps: int = Field(default=400, ge=0)
    """Optimizer steps (one batch each)."""
    max_wall_s: float | None = Field(default=None, gt=0)
    """Stop after this much wall time (evaluation included), if set."""
    target_gain: float | None = Field(default=None, gt=0)
    """Stop at the first evaluation whose held-out pass rate is at least step 0's plus this, if set."""
    num_prompts_per_step: int = Field(default=32, ge=1)
    """B: prompts per batch."""
    group_size: int = Field(default=8, ge=2)
    """G: completions sampled per prompt."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature (the loss uses the same distribution)."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Completion budget; default: longest reference + EOS + 2."""
    length_control: bool = True
    """Sample under the task's interruption length control when it has one (a dataset task's
    ``length_control``), as the generators do: a thinking budget drawn per group, the phrase out of the
    loss (services/embedded/sampling.py)."""
    lr: float = Field(default=1e-4, gt=0)
    """AdamW learning rate after warm-up (3e-4 learns faster on-policy but collapses at 8 steps of lag)."""
    warmup_steps: int = Field(default=10, ge=0)
    """Linear learning-rate warm-up steps."""
    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW weight decay."""
    adam_eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping by global norm."""
    eps_max: float = Field(default=4.0, gt=0)
    """CISPO cap on the IS weight itself (ScaleRL convention)."""
    normalization: Literal["batch", "group", "none"] = "batch"
    """Advantage normalisation (docs/recipe.md, "Advantages")."""
    aggregation: Literal["prompt", "sample", "token"] = "prompt"
    """Token-loss aggregation (docs/recipe.md, "Losses")."""
    eval_every_steps: int = Field(default=50, ge=1)
    """Steps between held-out evaluations (step 0 and the last step always)."""
    eval_samples_per_prompt: int = Field(default=4, ge=1)
    """k: samples per held-out prompt in an evaluation."""
    lag_steps: int = Field(default=0, ge=0)
    """Train on rollouts sampled this many updates earlier (simulates PipelineRL staleness)."""
    seed: int = 0
    """Seed of prompt order and sampling."""


@dataclass(frozen=True)
class Rollouts:
    """One step's sampled groups, prompt-major: row p * G + g is sample g of prompt p."""

    rows: list[list[int]]
    """Prompt token ids of every row."""
    samples: Samples
    """Completions, their sampling log-probs and truncation flags."""
    loss_masks: list[list[int]]
    """Per completion token: 0 where length control injected it (out of the loss)."""
    rewards: torch.Tensor
    """[B, G] verifier scores."""


def _evaluate(model: Any, tokenizer: Any, task: Task, s: OnPolicySettings, step: int, max_new: int) -> dict[str, float]:
    started = time.perf_counter()
    result = evaluate_pass_rate(
        model,
        tokenizer,
        task,
        s.eval_samples_per_prompt,
        temperature=s.temperature,
        seed=s.seed + 7919 * (step + 1),
        max_new_tokens=max_new,
        length=length_control_of(task) if s.length_control else None,
    )
    return {
        "eval/pass_rate": result.pass_rate,
        "eval/truncation_rate": result.truncation_rate,
        "time/eval_s": time.perf_counter() - started,
    }


def _update(
    model: Any, optimizer: torch.optim.Optimizer, rollouts: Rollouts, s: OnPolicySettings, lr: float, pad_id: int
) -> dict[str, float]:
    """One CISPO step on the non-zero-variance groups of ``rollouts``; returns loss metrics."""
    group = s.group_size
    advantages, keep = group_advantages(rewards=rollouts.rewards, normalization=s.normalization)
    metrics: dict[str, float] = {"batch/kept_prompts": float(keep.sum())}
    kept_rows = [p * group + g for p in range(keep.numel()) if keep[p] for g in range(group)]
    if not kept_rows:
        return metrics
    model.train()
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    batch = pack([rollouts.rows[r] for r in kept_rows], [rollouts.samples.completions[r] for r in kept_rows], pad_id)
    logp_gen = torch.zeros(batch.completion_mask.shape)
    sampled = torch.zeros(batch.completion_mask.shape)
    for n, r in enumerate(kept_rows):
        logp_gen[n, : len(rollouts.samples.logprobs[r])] = torch.tensor(rollouts.samples.logprobs[r])
        sampled[n, : len(rollouts.loss_masks[r])] = torch.tensor(rollouts.loss_masks[r], dtype=torch.float32)
    # Kept prompts renumbered 0..P'-1 for prompt-level aggregation.
    prompt_index = torch.arange(len(kept_rows)) // group
    logp = completion_logprobs(model, batch, temperature=s.temperature)
    mask = batch.completion_mask.float() * sampled
    loss, stats = cispo_loss(
        logp=logp,
        logp_gen=logp_gen,
        advantages=advantages[keep].reshape(-1),
        mask=mask,
        prompt_index=prompt_index,
        eps_max=s.eps_max,
        aggregation=s.aggregation,
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.max_grad_norm)
    optimizer.step()
    num_tokens = mask.sum().clamp_min(1.0)
    log_ratio = (logp.detach() - logp_gen) * mask
    metrics.update(
        {
            "loss/value": loss.item(),
            "loss/grad_norm": float(grad_norm),
            "loss/lr": lr,
            # With lag_steps = 0 this compares the KV-cached sampler with the
            # training forward on the same weights: ~1e-6, else they disagree.
            "is/mean_abs_log_ratio": float(log_ratio.abs().sum() / num_tokens),
            "policy/nll": float(-(logp.detach() * mask).sum() / num_tokens),
            **stats,
        }
    )
    return metrics


def run_onpolicy(model_dir: Path, settings: OnPolicySettings | None = None) -> list[dict[str, Any]]:
    """Train the model in ``model_dir`` (in memory) with on-policy CISPO.

    Returns one record per step (step 0 is the evaluation before training):
    batch pass rate, loss metrics, and the wall time split into generation
    and update; steps with an evaluation also carry ``eval/pass_rate``;
    ``time/eval_total_s`` is the wall time spent evaluating so far.
    """
    s = settings or OnPolicySettings()
    task = get_task(s.task.name, s.task)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir)
    pad = tokenizer.pad_token_id
    problems = list(task.problems("train"))
    fmt = format_for(task, tokenizer)
    prompt_ids = encode_prompts(tokenizer, problems, fmt)
    max_new = s.max_new_tokens or max_new_tokens_for(tokenizer, problems, fmt=fmt)
    length = length_control_of(task) if s.length_control else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, eps=s.adam_eps, weight_decay=s.weight_decay)
    rng = random.Random(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    order: list[int] = []
    in_flight: deque[Rollouts] = deque()
    num_updates = 0

    started = time.perf_counter()
    records: list[dict[str, Any]] = [{"step": 0, **_evaluate(model, tokenizer, task, s, 0, max_new)}]
    r0 = records[0]["eval/pass_rate"]
    eval_s = time.perf_counter() - started
    records[0].update({"wall_s": eval_s, "time/eval_total_s": eval_s})
    log.info("step 0: held-out pass rate %.3f", records[0]["eval/pass_rate"])
    for step in range(1, s.num_steps + 1):
        if len(order) < s.num_prompts_per_step:
            fresh = list(range(len(problems)))
            rng.shuffle(fresh)
            order.extend(fresh)
        idx, order = order[: s.num_prompts_per_step], order[s.num_prompts_per_step :]

        t0 = time.perf_counter()
        model.eval()
        rows = [prompt_ids[i] for i in idx for _ in range(s.group_size)]
        keys = [f"train:{s.seed}:{step}:{i}" for i in idx for _ in range(s.group_size)]
        drawn = sample_groups(model, tokenizer, rows, keys, max_new, length, s.temperature, gen)
        samples = drawn.samples
        texts = tokenizer.batch_decode(samples.completions, skip_special_tokens=True)
        refs = [problems[i].reference for i in idx for _ in range(s.group_size)]
        rewards = torch.tensor([task.score(t, r) for t, r in zip(texts, refs)]).view(len(idx), s.group_size)
        in_flight.append(Rollouts(rows=rows, samples=samples, loss_masks=drawn.loss_masks, rewards=rewards))
        gen_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        record: dict[str, Any] = {
            "step": step,
            "batch/pass_rate": float(rewards.mean()),
            "batch/truncation_rate": sum(samples.truncated) / len(rows),
            "batch/interruption_rate": sum(drawn.interrupted) / len(rows),
        }
        if len(in_flight) > s.lag_steps:
            num_updates += 1
            lr = s.lr * min(1.0, num_updates / max(1, s.warmup_steps))
            record.update(_update(model, optimizer, in_flight.popleft(), s, lr, pad))
        record["time/gen_s"] = gen_s
        record["time/update_s"] = time.perf_counter() - t1
        done = step == s.num_steps or (s.max_wall_s is not None and time.perf_counter() - started >= s.max_wall_s)
        if step % s.eval_every_steps == 0 or done:
            t2 = time.perf_counter()
            model.eval()
            record.update(_evaluate(model, tokenizer, task, s, step, max_new))
            eval_s += time.perf_counter() - t2
            if s.target_gain is not None and record["eval/pass_rate"] - r0 >= s.target_gain:
                done = True
            log.info(
                "step %d: held-out pass rate %.3f, batch pass rate %.3f, gen %.3fs update %.3fs (%.0fs)",
                step,
                record["eval/pass_rate"],
                record["batch/pass_rate"],
                gen_s,
                record["time/update_s"],
                time.perf_counter() - started,
            )
        record["wall_s"] = time.perf_counter() - started
        record["time/eval_total_s"] = eval_s
        records.append(record)
        if done:
            break
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Single-process on-policy CISPO on a local model directory.")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", type=Path, help="model directory to start from")
    src.add_argument("--cache-dir", type=Path, help="warm-start the default model into this cache and use it")
    parser.add_argument("--settings", default="{}", help="JSON overrides of OnPolicySettings")
    parser.add_argument("--metrics", type=Path, default=None, help="write one JSON record per step here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging("onpolicy", "text", args.log_level)
    torch.set_num_threads(args.threads)
    settings = OnPolicySettings.model_validate(json.loads(args.settings))
    log.info("on-policy settings: %s", settings.model_dump_json())
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = prepare_model(args.cache_dir, task_settings=settings.task)
    records = run_onpolicy(model_dir, settings)
    if args.metrics is not None:
        args.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    evals = [r for r in records if "eval/pass_rate" in r]
    steps = [r for r in records if "time/gen_s" in r]
    if steps:
        gen = sum(r["time/gen_s"] for r in steps) / len(steps)
        upd = sum(r["time/update_s"] for r in steps) / len(steps)
        print(f"{len(steps)} steps, mean generation {gen:.3f}s + update {upd:.3f}s per step")
    for r in evals:
        print(f"step {r['step']:4d}  wall {r['wall_s']:7.1f}s  held-out pass rate {r['eval/pass_rate']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
