"""The generator-learner log-prob gap on a bf16 model, with the generator's FP32 LM head on and off.

Owns the FP32-head figure. A Qwen3-style model (random weights, BPE
tokenizer, chat template) is stored in bf16, as hub checkpoints are. A bf16
vLLM engine with the FP32 head samples completions of chat prompts; then
the same token sequences are scored three ways:

- by the learner: float32 master weights, the body under bf16 autocast,
  the FP32 head (its configuration on a GPU);
- by the bf16 engine with its FP32 head on (the default), and
- by a bf16 engine with the head off (logits in bf16),

each engine through a full forward over the sequence (prompt log-probs), so
both engines score identical tokens. The figure is the mean absolute gap
to the learner over every completion token, head off against head on.

    python -m benchmarks.fp32_head --output DIR

Target: the mean gap with the FP32 head off / with it on >= 1 (the head
brings the generator's log-probs no further from the learner's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.figure import Figure, Target

BENCH_FILE_NAME = "fp32_head_bench.json"
TARGET = 1.0
PROMPTS = [
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "A train travels 60 km in 1 hour. How far does it go in 3 hours?",
    "Sara reads 12 pages a day. How many pages does she read in a week?",
    "There are 24 students in 4 equal rows. How many are in each row?",
]
SAMPLES = 4
MAX_TOKENS = 48
LOGIT_STD = 4.0
SHAPE: dict[str, Any] = {"hidden_size": 512, "num_layers": 4, "intermediate_size": 1024, "num_heads": 8}


async def engine_scores(model_dir: Path, fp32_head: bool, sequences: list[list[int]]) -> list[list[float]]:
    from services.generator.config import EngineSettings
    from services.generator.engine import Engine

    engine = Engine(
        EngineSettings(
            model_dir=model_dir,
            dtype="bfloat16",
            fp32_lm_head=fp32_head,
            max_num_seqs=16,
            kv_cache_memory_bytes=32 << 20,
        )
    )
    await engine.start()
    try:
        return [await engine.prompt_logprobs(ids) for ids in sequences]
    finally:
        await engine.shutdown()


async def sample_sequences(model_dir: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) sampled by the bf16 engine with its FP32 head."""
    from services.generator.config import EngineSettings
    from services.generator.engine import Engine
    from services.learner.model import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    engine = Engine(
        EngineSettings(model_dir=model_dir, dtype="bfloat16", max_num_seqs=16, kv_cache_memory_bytes=32 << 20)
    )
    await engine.start()
    rows = []
    try:
        for i, question in enumerate(PROMPTS):
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
            prompt_ids, samples = await engine.sample(str(prompt), SAMPLES, 1.0, 1.0, MAX_TOKENS, seed=7 + i)
            rows += [(prompt_ids, s.token_ids) for s in samples if s.token_ids]
    finally:
        await engine.shutdown()
    return rows


def learner_scores(model_dir: Path, rows: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    import torch

    from services.learner.model import Precision, completion_logprobs, load_model, load_tokenizer, pack

    precision = Precision(torch.device("cpu"), torch.bfloat16)
    model = load_model(model_dir).eval()
    pad = load_tokenizer(model_dir).pad_token_id or 0
    batch = pack([p for p, _ in rows], [c for _, c in rows], pad)
    with torch.no_grad():
        logp = completion_logprobs(model, batch, precision=precision)
    return [[float(logp[i, t]) for t in range(len(c))] for i, (_, c) in enumerate(rows)]


def gaps(rows: list[tuple[list[int], list[int]]], engine: list[list[float]], learner: list[list[float]]) -> list[float]:
    out = []
    for (prompt, completion), scored, reference in zip(rows, engine, learner):
        tail = scored[len(prompt) - 1 :]  # the completion tokens' log-probs
        assert len(tail) == len(completion) == len(reference)
        out += [abs(a - b) for a, b in zip(tail, reference)]
    return out


def sharpen_head(model_dir: Path) -> None:
    """Scale the LM head so logits spread as a trained model's do (std about LOGIT_STD, not ~0.1).

    bf16 keeps 8 bits of mantissa: a logit's rounding error grows with its
    size, so a random model's near-zero logits would hide what the FP32 head
    is for.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from services.learner.model import load_model, load_tokenizer

    model = load_model(model_dir)
    ids = load_tokenizer(model_dir)(PROMPTS[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        std = float(model(ids).logits.std())
    file = model_dir / "model.safetensors"
    tensors = load_file(str(file))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * (LOGIT_STD / std)
    save_file(tensors, str(file), metadata={"format": "pt"})


def bench_fp32_head(workdir: Path | None = None) -> Figure:
    import torch

    from services.embedded.build import cast_model_dir, create_test_model_dir

    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="fp32-head-bench-") as tmp:
            return bench_fp32_head(Path(tmp))
    model_dir = create_test_model_dir("qwen3", False, workdir / "qwen3-bf16", **SHAPE)
    sharpen_head(model_dir)
    model_dir = cast_model_dir(model_dir, torch.bfloat16)
    rows = asyncio.run(sample_sequences(model_dir))
    sequences = [p + c for p, c in rows]
    learner = learner_scores(model_dir, rows)
    on = gaps(rows, asyncio.run(engine_scores(model_dir, True, sequences)), learner)
    off = gaps(rows, asyncio.run(engine_scores(model_dir, False, sequences)), learner)
    mean_on, mean_off = statistics.fmean(on), statistics.fmean(off)
    return Figure(
        name="fp32_head_logprob_gap_off_vs_on",
        value=mean_on,
        unit="nats",
        ratio=mean_off / mean_on,
        baseline=f"FP32 head off: mean |gap| {mean_off:.4f}, max {max(off):.4f}",
        measured=f"FP32 head on: mean |gap| {mean_on:.4f}, max {max(on):.4f} ({len(on)} tokens of {len(rows)} completions)",
        targets=(Target(of="ratio", direction="at least", bound=TARGET),),
        details={
            "tokens": len(on),
            "completions": len(rows),
            "mean_gap_on": mean_on,
            "max_gap_on": max(on),
            "mean_gap_off": mean_off,
            "max_gap_off": max(off),
            "model": {"family": "qwen3", "dtype": "bfloat16", **SHAPE},
        },
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp32_head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help=f"directory for {BENCH_FILE_NAME}")
    args = parser.parse_args(argv)
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    args.output.mkdir(parents=True, exist_ok=True)
    figure = bench_fp32_head()
    (args.output / BENCH_FILE_NAME).write_text(json.dumps(figure.as_json(), indent=2) + "\n")
    print(
        f"fp32 head: {figure.measured} vs {figure.baseline}: ratio {figure.ratio:.2f} (target {figure.target}; {figure.verdict})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
