"""Learner start and checkpoints at scale: memory of a load and a resume, time of a step that checkpoints.

Owns the benchmarks of how the learner gets its weights and keeps them.
Two gloo ranks under torchrun, FSDP2 (the GPU layout), one thread a rank:

- **load**: a Llama of about 300M parameters, stored in bf16 as hubs ship
  them, loaded as the learner loads it (built on the meta device, sharded,
  each rank reading only its rows of each stored tensor) against the whole
  float32 load every rank used to do (``from_pretrained``, then sharding).
  Per rank: the peak of tensor bytes during the load (the PyTorch profiler's
  allocator events, ``learner_memory.profiled_peak``) against the float32
  model and one decoder layer, and peak RSS beside it;
- **resume**: the same model resumed from a learner checkpoint written by
  two ranks (weights and AdamW state), against the whole training state;
- **checkpoint**: a Llama of about 100M parameters taking steps in rounds:
  plain steps, a step that starts a checkpoint (``torch.distributed.checkpoint``
  async save: the state staged in host memory, then written behind the
  next steps), those next steps, and a step that saves as the learner used
  to (the whole state gathered on rank 0, written and fsynced while every
  rank waits). Each kind's median step against the plain steps'.

    python -m benchmarks.learner_state --output DIR [--quick]

Targets: load peak per rank <= 0.55 x the float32 model + one decoder layer;
resume peak per rank <= 0.55 x the training state (float32 weights and
AdamW's two moments) + one decoder layer; a step that checkpoints <= 1.3 x
a step that does not. ``--quick`` runs models of a few million parameters
(the same code paths; the figures are not held to their targets there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import learner_memory
from benchmarks.figure import Figure, Target, quantity, write_and_print
from benchmarks.learner_memory import profiled_peak

BENCH_FILE_NAME = "learner_state_bench.json"
LOAD_TARGET = 0.55
STEP_TARGET = 1.3
MB = 1e6


def load_spec(quick: bool) -> dict[str, Any]:
    """The load model's Llama config: 20 x 11.8M + 2 x 32.8M = 302M parameters (quick: 2.8M)."""
    if quick:
        return {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "vocab_size": 4096}
    return {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 20, "vocab_size": 32000}


def step_spec(quick: bool) -> dict[str, Any]:
    """The checkpoint model's Llama config: 14 x 7.1M + 2 x 6.3M = 112M parameters (quick: 0.9M)."""
    if quick:
        return {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "vocab_size": 2048}
    return {"hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 14, "vocab_size": 8192}


def build_model_dir(spec: dict[str, Any], out: Path, dtype_name: str) -> Path:
    """A random Llama saved as a model directory (weights in ``dtype_name``), no tokenizer needed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    heads = spec["hidden_size"] // 64
    config = LlamaConfig(
        **spec,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype_name))
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(out)
    return out


def synthetic_batch(vocab: int, prompts: int, group: int, prompt_len: int, completion_len: int, seed: int) -> Any:
    from asymptote.contracts.v1 import rollout_pb2
    from services.learner.trainer import collate

    rng = random.Random(seed)
    groups = []
    for p in range(prompts):
        completions = [
            rollout_pb2.Completion(
                token_ids=[rng.randrange(2, vocab) for _ in range(completion_len)],
                logprobs=[-rng.uniform(0.5, 4.0) for _ in range(completion_len)],
                version_spans=[rollout_pb2.VersionSpan(version=0, start=0, end=completion_len)],
                reward=float(i % 2),
            )
            for i in range(group)
        ]
        task = rollout_pb2.GenerationTask(task_id=f"t{p}", sampling=rollout_pb2.SamplingParams(temperature=1.0))
        groups.append(
            rollout_pb2.RolloutGroup(
                group_id=f"g{seed}-{p}",
                task=task,
                prompt_token_ids=[rng.randrange(2, vocab) for _ in range(prompt_len)],
                completions=completions,
            )
        )
    return collate(groups, pad_id=0)


# -- the workers: one rank each ---------------------------------------------


def _trainer(model: Any, dp: Any) -> Any:
    from services.learner.config import LossSettings, OptimizerSettings
    from services.learner.trainer import Trainer

    return Trainer(model, LossSettings(), OptimizerSettings(lr=1e-5, warmup_steps=0), dp, parallelism="fsdp")


def _sizes(model_dir: Path) -> dict[str, int]:
    """The float32 model's bytes and its largest decoder layer's."""
    from services.learner.layers import decoder_layers
    from services.learner.model import empty_model

    model = empty_model(model_dir)
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model))
    return {"model_fp32_bytes": 4 * sum(p.numel() for p in model.parameters()), "layer_fp32_bytes": 4 * layer}


def load_worker(mode: str, model_dir: Path, out: Path) -> None:
    """``meta``: the learner's load (then a step and a checkpoint for ``resume``); ``whole``: the old load;
    ``resume``: start from that checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.learner import checkpoint
    from services.learner.distributed import DataParallel
    from services.learner.model import empty_model

    torch.set_num_threads(1)
    dp = DataParallel.from_env("gloo")
    box: dict[str, Any] = {}

    def load() -> None:
        if mode == "whole":
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
            # transformers reads on threads of its own, which the profiler does not follow: what the
            # rank holds once loaded is the floor of its peak.
            box["held"] = sum(p.untyped_storage().nbytes() for p in model.parameters())
            box["trainer"] = _trainer(model, dp)
        else:
            box["trainer"] = _trainer(empty_model(model_dir), dp)
            found = checkpoint.latest(out / "checkpoints") if mode == "resume" and dp.is_main else None
            box["restored"] = box["trainer"].start(model_dir, found)

    started = time.perf_counter()
    peak = max(profiled_peak(load), box.get("held", 0))
    report: dict[str, Any] = {
        "mode": mode,
        "rank": dp.rank,
        "load_s": time.perf_counter() - started,
        "peak_tensor_bytes": peak,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **_sizes(model_dir),
    }
    trainer = box["trainer"]
    if mode == "resume":
        report["resumed_step"] = box["restored"].step if dp.is_main else None
    if mode == "meta":  # a step (AdamW's state exists) and a checkpoint for the resume run
        trainer.checkpointer = checkpoint.Checkpointer(out / "checkpoints", 1, distributed=True, rank=dp.rank)
        if dp.is_main:
            vocab = int(trainer.model.config.vocab_size)
            trainer.step(synthetic_batch(vocab, 2, 2, 8, 8, seed=1), learner_version=0)
            trainer.save(1, trainer.meta(1, 1))
            trainer.checkpointer.finish()
            trainer.release_followers()
        else:
            trainer.follow()
    (out / f"load-{mode}.rank{dp.rank}.json").write_text(json.dumps(report))
    trainer.close()
    dp.close()


def consolidated_save(trainer: Any, root: Path, version: int) -> None:
    """The learner's checkpoint before sharding: the whole state gathered on rank 0, then written and fsynced."""
    import torch
    from safetensors.torch import save_file

    state = trainer.full_state()
    folder = root / f"consolidated-{version:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in state.weights.items()}, str(folder / "model.safetensors"))
    torch.save({"optimizer": state.optimizer, "scheduler": state.scheduler}, folder / "trainer.pt")
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(folder)


def step_worker(model_dir: Path, out: Path, rounds: int, steps_each: int) -> None:
    """Rounds of: plain steps, a step that starts a checkpoint, the steps its write runs behind, a step
    with the consolidated save; rank 0 times each step by kind."""
    import torch

    from services.learner import checkpoint
    from services.learner.distributed import DataParallel
    from services.learner.model import empty_model

    torch.set_num_threads(1)
    dp = DataParallel.from_env("gloo")
    trainer = _trainer(empty_model(model_dir), dp)
    trainer.start(model_dir)
    trainer.checkpointer = checkpoint.Checkpointer(out / "step-checkpoints", 1, distributed=True, rank=dp.rank)
    if not dp.is_main:
        trainer.follow()
        trainer.close()
        dp.close()
        return
    vocab = int(trainer.model.config.vocab_size)
    batch = synthetic_batch(vocab, 2, 4, 16, 24, seed=2)
    times: dict[str, list[float]] = {"plain": [], "checkpoint": [], "behind": [], "consolidated": [], "stage": []}
    write_s: list[float] = []
    version = 0
    trainer.step(batch, learner_version=0)  # warm-up: AdamW's state is allocated in the first step
    for _ in range(rounds):
        for kind in ["plain"] * steps_each + ["checkpoint"] + ["behind"] * steps_each + ["consolidated"]:
            version += 1
            t0 = time.perf_counter()
            trainer.step(batch, learner_version=version)
            if kind == "checkpoint":
                t1 = time.perf_counter()
                trainer.save(version, trainer.meta(version, version))
                times["stage"].append(time.perf_counter() - t1)
                started = t1
            elif kind == "consolidated":
                consolidated_save(trainer, out / "consolidated", version)
            times[kind].append(time.perf_counter() - t0)
        trainer.checkpointer.finish()  # every rank's shards written: commit (waits if the write is not done)
        write_s.append(time.perf_counter() - started)
    trainer.release_followers()
    (out / "steps.json").write_text(
        json.dumps(
            {
                "times": times,
                "checkpoint_to_commit_s": write_s,
                "num_parameters": sum(p.numel() for p in trainer.model.parameters()),
            }
        )
    )
    trainer.close()
    dp.close()


# -- the driver ---------------------------------------------------------------


def torchrun(args: list[str]) -> None:
    learner_memory.torchrun(2, args, timeout_s=1800.0, module="benchmarks.learner_state")


def _ranks(out: Path, mode: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"load-{mode}.rank{r}.json").read_text()) for r in range(2)]


def load_figures(runs: dict[str, list[dict[str, Any]]], quick: bool) -> list[Figure]:
    first = runs["meta"][0]
    model, layer = first["model_fp32_bytes"], first["layer_fp32_bytes"]
    state = 3 * model  # float32 weights and AdamW's two moments
    figures = []
    for mode, whole, what in (("meta", model, "float32 model"), ("resume", state, "weights + AdamW state")):
        peak = max(r["peak_tensor_bytes"] for r in runs[mode])
        bound = LOAD_TARGET * whole + layer
        baseline = max(r["peak_tensor_bytes"] for r in runs["whole"]) if mode == "meta" else None
        figures.append(
            Figure(
                name=f"learner_{'load' if mode == 'meta' else 'resume'}_peak_per_rank_2_ranks",
                value=peak / MB,
                unit="MB",
                ratio=peak / whole,
                baseline=(
                    f"{what} {whole / MB:,.0f} MB"
                    + (f"; the whole float32 load peaked at {baseline / MB:,.0f} MB a rank" if baseline else "")
                ),
                measured=f"peak tensor bytes per rank while loading, {model / 4e6:.0f}M-parameter Llama stored in "
                f"bf16, two FSDP2 ranks; peak RSS {max(r['peak_rss_bytes'] for r in runs[mode]) / MB:,.0f} MB",
                targets=()
                if quick
                else (
                    Target(
                        of="value",
                        direction="at most",
                        bound=bound / MB,
                        rule=f"{LOAD_TARGET} x {what} + one decoder layer ({layer / MB:,.0f} MB)",
                    ),
                ),
                details={"runs": runs},
            )
        )
    return figures


def step_figure(steps: dict[str, Any], quick: bool) -> Figure:
    times = steps["times"]
    plain = statistics.median(times["plain"])
    ckpt = statistics.median(times["checkpoint"])
    behind = statistics.median(times["behind"])
    consolidated = statistics.median(times["consolidated"])
    stage = statistics.median(times["stage"])
    return Figure(
        name="learner_checkpoint_step_vs_plain_step",
        value=ckpt,
        unit="s",
        ratio=ckpt / plain,
        baseline=f"a step without a checkpoint {quantity(plain, 's')}; a step while the shards are written "
        f"{quantity(behind, 's')} ({behind / plain:.2f}x); a step with the consolidated save "
        f"{quantity(consolidated, 's')} ({consolidated / plain:.2f}x)",
        measured=f"median step that starts an async sharded checkpoint (staging {quantity(stage, 's')}; "
        f"begun to committed {quantity(statistics.median(steps['checkpoint_to_commit_s']), 's')}), "
        f"{steps['num_parameters'] / 1e6:.0f}M-parameter Llama, two FSDP2 gloo ranks of one thread each",
        targets=() if quick else (Target(of="ratio", direction="at most", bound=STEP_TARGET),),
        details=steps,
    )


def bench_learner_state(quick: bool, workdir: Path) -> list[Figure]:
    workdir.mkdir(parents=True, exist_ok=True)
    load_dir = build_model_dir(load_spec(quick), workdir / "load-model", "bfloat16")
    runs = {}
    for mode in ("whole", "meta", "resume"):  # resume reads the checkpoint the meta run wrote
        torchrun(["--load", mode, "--model", str(load_dir), "--workdir", str(workdir)])
        runs[mode] = _ranks(workdir, mode)
    step_dir = build_model_dir(step_spec(quick), workdir / "step-model", "float32")
    rounds, each = (1, 1) if quick else (3, 3)
    torchrun(["--steps", f"{rounds},{each}", "--model", str(step_dir), "--workdir", str(workdir)])
    steps = json.loads((workdir / "steps.json").read_text())
    return [*load_figures(runs, quick), step_figure(steps, quick)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.learner_state", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help=f"directory for {BENCH_FILE_NAME} and the runs")
    parser.add_argument("--quick", action="store_true", help="models of a few million parameters")
    parser.add_argument("--load", choices=["whole", "meta", "resume"], help=argparse.SUPPRESS)
    parser.add_argument("--steps", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load:
        load_worker(args.load, args.model, args.workdir)
        return 0
    if args.steps:
        rounds, each = (int(x) for x in args.steps.split(","))
        step_worker(args.model, args.workdir, rounds, each)
        return 0
    if args.output is None:
        parser.error("--output is required")
    write_and_print(bench_learner_state(args.quick, args.output / "learner_state"), args.output / BENCH_FILE_NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
