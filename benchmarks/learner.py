"""The learner's step against a bare PyTorch step of the same work.

Owns the learner-overhead benchmark: one optimizer step as the service takes
it (decoded rollout groups collated, advantages, the configured loss,
backward, clipping, AdamW, the step's metrics) against a hand-written
minimal step (forward, CISPO with prompt aggregation, backward, AdamW) on
the same model, tokens and rewards, interleaved in one run so machine noise
hits both alike.

    python -m benchmarks.learner --output DIR [--repeats 30]

Target: service step / bare step <= 1.15.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from asymptote.contracts.v1 import rollout_pb2
from asymptote.tasks import ALPHABET
from benchmarks.figure import Figure, Target
from services.embedded.build import ModelSpec, build_model, build_tokenizer
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.trainer import Trainer, collate

TARGET = 1.15
BENCH_FILE_NAME = "learner_bench.json"


def synthetic_groups(
    vocab: int, num_prompts: int, group_size: int, prompt_len: int, max_new: int, seed: int = 0
) -> list[rollout_pb2.RolloutGroup]:
    """Groups shaped like the embedded default's (random tokens, half the rewards 1)."""
    rng = random.Random(seed)
    groups = []
    for p in range(num_prompts):
        completions = []
        for i in range(group_size):
            n = rng.randint(2, max_new)
            completions.append(
                rollout_pb2.Completion(
                    token_ids=[rng.randrange(4, vocab) for _ in range(n)],
                    logprobs=[-rng.uniform(0.01, 3.0) for _ in range(n)],
                    version_spans=[rollout_pb2.VersionSpan(version=0, start=0, end=n)],
                    reward=float(i % 2),
                )
            )
        task = rollout_pb2.GenerationTask(
            task_id=f"g{p}", kind=rollout_pb2.TASK_KIND_TRAIN, sampling=rollout_pb2.SamplingParams(temperature=1.0)
        )
        groups.append(
            rollout_pb2.RolloutGroup(
                group_id=f"g{p}",
                task=task,
                prompt_token_ids=[1] + [rng.randrange(4, vocab) for _ in range(prompt_len)],
                completions=completions,
            )
        )
    return groups


def bare_step(model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: Any, eps_max: float) -> None:
    """The minimum an RL step needs: forward, CISPO (prompt aggregation), backward, AdamW."""
    b = inputs.batch
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    logp = torch.log_softmax(logits[:, b.prompt_len - 1 : -1].float(), -1)
    logp = logp.gather(-1, b.input_ids[:, b.prompt_len :, None]).squeeze(-1)
    adv = inputs.rewards - inputs.rewards.mean(1, keepdim=True)
    adv = (adv / adv.std().clamp_min(1e-8)).reshape(-1)
    w = torch.exp(logp.detach() - inputs.logp_gen).clamp(max=eps_max)
    mask = inputs.loss_mask
    per_token = -w * adv[:, None] * logp * mask
    prompt_sum = torch.zeros(inputs.num_prompts).index_add(0, inputs.prompt_index, per_token.sum(1))
    prompt_tokens = torch.zeros(inputs.num_prompts).index_add(0, inputs.prompt_index, mask.sum(1))
    loss = (prompt_sum / prompt_tokens.clamp_min(1)).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def bench_learner_step(repeats: int = 30, num_prompts: int = 32, group_size: int = 8) -> Figure:
    """Median seconds of the service step against the bare step, interleaved; their ratio is the figure."""
    torch.manual_seed(0)
    spec = ModelSpec()
    tok = build_tokenizer(ALPHABET, spec.vocab_multiple)
    service_model = build_model(spec, tok)
    bare_model = copy.deepcopy(service_model)
    loss = LossSettings()
    trainer = Trainer(service_model, loss, OptimizerSettings(warmup_steps=0))
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-4, weight_decay=0.01)
    groups = synthetic_groups(len(tok), num_prompts, group_size, prompt_len=8, max_new=7)
    pad = int(tok.pad_token_id)
    pre = collate(groups, pad)
    service_s, bare_s = [], []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        trainer.step(collate(groups, pad), learner_version=0)
        t1 = time.perf_counter()
        bare_step(bare_model, bare_opt, pre, loss.eps_max)
        t2 = time.perf_counter()
        if i >= 3:  # warm-up
            service_s.append(t1 - t0)
            bare_s.append(t2 - t1)
    service, bare = statistics.median(service_s), statistics.median(bare_s)
    samples = num_prompts * group_size
    return Figure(
        name="learner_step_service_vs_bare",
        value=service,
        unit="s",
        ratio=service / bare,
        baseline=f"bare PyTorch step {bare * 1e3:.1f} ms",
        measured=f"service step {service * 1e3:.1f} ms ({samples} samples), median of {repeats}",
        targets=(Target(of="ratio", direction="at most", bound=TARGET),),
        details={"service_step_s": service, "bare_step_s": bare, "repeats": repeats, "samples_per_step": samples},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.learner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME}")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    figure = bench_learner_step(args.repeats)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / BENCH_FILE_NAME).write_text(json.dumps(figure.as_json(), indent=2) + "\n")
    print(f"{figure.name}: {figure.measured} vs {figure.baseline} (target {figure.target}: {figure.verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
