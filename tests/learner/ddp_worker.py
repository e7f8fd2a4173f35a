"""Run under torchrun by test_distributed.py: the learner's Trainer on fixed batches.

Rank 0 builds the batches and calls ``Trainer.step`` as the service does;
the other ranks ``follow``. For every loss configuration a fresh tiny model
(same seed) takes the same steps in the layout ``--parallelism`` names;
rank 0 writes the final whole parameters, its step metrics and the weights
it would serve (against an unsharded copy's) to ``--out``, and the other
ranks of a DDP run their own replica's parameters. ``--checkpoint-after K``
writes a learner checkpoint after step K; ``--resume DIR`` starts from the
checkpoints of such a run and takes only the steps after it. ``--dtype
bfloat16`` computes the body in bf16 (FSDP2's mixed precision when sharded).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from asymptote.contracts.v1 import rollout_pb2
from asymptote.lora import LoraSettings
from services.learner import checkpoint
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.distributed import DataParallel
from services.learner.model import TORCH_DTYPES, Precision, aliases
from services.learner.trainer import Trainer, collate
from services.learner.weights import WeightStore

CONFIGS = {
    "cispo-prompt-batch": LossSettings(),
    "grpo-tis-sample-group": LossSettings(name="grpo", tis_cap=2.0, aggregation="sample", normalization="group"),
    "dapo-token-none": LossSettings(name="dapo", aggregation="token", normalization="none"),
    "gspo-sample-batch": LossSettings(name="gspo", aggregation="sample"),
}
VOCAB = 24


def tiny_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1234)
    return LlamaForCausalLM(config).float()


def batch(rng: random.Random, step: int, num_prompts: int, group_size: int = 4) -> list[rollout_pb2.RolloutGroup]:
    """Random groups with the edge cases: a zero-variance prompt, one-token completions,
    injected (masked) tokens, truncation, rewards in {0, 1} and {-1, +1}, stale token versions."""
    signed = step % 2 == 1
    groups = []
    for p in range(num_prompts):
        prompt = [1] + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 6))]
        completions = []
        for i in range(group_size):
            n = 1 if i == 0 else rng.randrange(1, 9)
            tokens = [rng.randrange(2, VOCAB) for _ in range(n)]
            if p == 1:
                reward = 1.0  # zero variance: out of the loss and its denominators
            else:
                reward = float(rng.random() < 0.5) * (2.0 if signed else 1.0) - (1.0 if signed else 0.0)
            mask = [0 if (n > 3 and t in (1, 2)) else 1 for t in range(n)]
            completions.append(
                rollout_pb2.Completion(
                    token_ids=tokens,
                    logprobs=[-rng.uniform(0.5, 4.0) for _ in range(n)],
                    version_spans=[rollout_pb2.VersionSpan(version=max(0, step - rng.randrange(0, 3)), start=0, end=n)],
                    reward=reward,
                    loss_mask=mask,
                    truncated=n == 8,
                )
            )
        if p != 1 and len({c.reward for c in completions}) == 1:
            completions[-1].reward = -completions[-1].reward if signed else 1.0 - completions[-1].reward
        task = rollout_pb2.GenerationTask(
            task_id=f"s{step}p{p}", sampling=rollout_pb2.SamplingParams(temperature=rng.choice([1.0, 0.7]))
        )
        groups.append(
            rollout_pb2.RolloutGroup(
                group_id=f"s{step}p{p}", task=task, prompt_token_ids=prompt, completions=completions
            )
        )
    return groups


def served_signature(model: torch.nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A model directory's signature for ``model``: the MLP served in bf16, the rest in float32."""
    return {
        name: ("bfloat16" if ".mlp." in name else "float32", tuple(t.shape)) for name, t in model.state_dict().items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--parallelism", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--micro-batch-tokens", type=int, default=None)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--checkpoint-after", type=int, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--lora-rank", type=int, default=None)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    args = parser.parse_args()
    lora = None if args.lora_rank is None else LoraSettings(rank=args.lora_rank, alpha=2 * args.lora_rank)
    torch.set_num_threads(1)
    dp = DataParallel.from_env("gloo")
    report: dict[str, object] = {"world_size": dp.world_size}
    for name in args.configs:
        loss = CONFIGS[name]
        model = tiny_model()
        trainer = Trainer(
            model,
            loss,
            OptimizerSettings(lr=1e-2, warmup_steps=1),
            dp,
            Precision(torch.device("cpu"), TORCH_DTYPES[args.dtype]),
            parallelism=args.parallelism,
            micro_batch_tokens=args.micro_batch_tokens,
            activation_checkpointing=args.activation_checkpointing,
            lora=lora,
        )
        report["sharded"] = trainer.sharded
        report["master_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        trainer.checkpointer = checkpoint.Checkpointer(
            args.out / "checkpoints" / name, keep=1, distributed=dp.distributed, rank=dp.rank
        )
        found = None
        if args.resume is not None and dp.is_main:
            found = checkpoint.latest(args.resume / "checkpoints" / name)
            assert found is not None, f"no checkpoint for {name} in {args.resume}"
        restored = trainer.start(None, found)  # rank 0 names the checkpoint; every rank reads its part
        start = 0 if restored is None else restored.step
        if dp.is_main:
            rng = random.Random(7)
            metrics = []
            # 5 prompts split 3 / 2 over two ranks; the last step has one prompt (one rank empty).
            for step, num_prompts in enumerate([5] * (args.steps - 1) + [1]):
                if num_prompts == 1:
                    groups = batch(rng, step, 2)[:1]
                else:
                    groups = batch(rng, step, num_prompts)
                if step < start:  # taken before the checkpoint (the batches are drawn all the same)
                    continue
                metrics.append(trainer.step(collate(groups, pad_id=0), learner_version=step))
                if args.checkpoint_after == step + 1:
                    trainer.save(step + 1, trainer.meta(step + 1, step + 1))
                    trainer.checkpointer.finish()
            # What rank 0 serves: the model directory's tensors, or with a LoRA the adapter's.
            signature = trainer.served_signature() or served_signature(tiny_model())
            store = WeightStore(signature)
            served = store.snapshot_tensors(1, trainer.served_tensors(store.names))
            final = trainer.full_state().weights
            trainer.release_followers()
            report[name] = metrics
            report[f"{name}/served"] = {
                "digest": served.digest,
                "names": sorted(served.tensors),
                "bytes": {k: len(t.data) for k, t in served.tensors.items()},
                "dtypes": {k: t.dtype for k, t in served.tensors.items()},
            }
            if lora is None:
                # The same weights in one unsharded model, served the plain way.
                plain = tiny_model()
                plain.load_state_dict(final, strict=False)
                reference = WeightStore(signature).snapshot(1, plain)
                report[f"{name}/served_unsharded"] = {
                    "digest": reference.digest,
                    "names": sorted(reference.tensors),
                    "bytes": {k: len(t.data) for k, t in reference.tensors.items()},
                    "dtypes": {k: t.dtype for k, t in reference.tensors.items()},
                }
            params = {k: v.clone().contiguous() for k, v in final.items()}
        else:
            report[f"{name}/followed"] = trainer.follow()
            tied = aliases(model)
            params = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k not in tied}
        trainer.close()
        if dp.is_main or not trainer.sharded:  # a sharded rank > 0 holds only its shards
            save_file(params, str(args.out / f"{name}.rank{dp.rank}.safetensors"))
    (args.out / f"report.rank{dp.rank}.json").write_text(json.dumps(report))
    dp.close()


if __name__ == "__main__":
    main()
