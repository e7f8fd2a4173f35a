"""The LM head's memory per token, chunked against whole, at Qwen3's vocabulary.

Owns the head-memory figure. The learner's head (services/learner/head.py)
against the head it replaced (the whole ``[tokens, vocab]`` float32 logits,
log-softmax and entropy held for the backward pass), each taking a forward
and a backward pass over ``tokens`` hidden states of width 1,024 (Qwen3-0.6B)
at a vocabulary of 151,936, on the CPU. Peak tensor bytes come from the
profiler's allocator events (``learner_memory.profiled_peak``), at two token
counts; bytes per token is the slope between them, so what does not grow
with the tokens (the head's weight and its gradient) is left out.

    python -m benchmarks.head --output DIR

Target: bytes per token at least 4x lower than the whole head's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.figure import Figure, Target, write_and_print
from benchmarks.learner_memory import profiled_peak

BENCH_FILE_NAME = "head_bench.json"
VOCAB, HIDDEN = 151_936, 1024
TOKENS = (1024, 2048)
"""Both past one chunk of the chunked head (441 tokens at this vocabulary), so its working set is whole at each."""
TARGET = 4.0


def whole_head(hidden: object, weight: object, targets: object) -> None:
    """The head before chunking (model.PolicyForward until then): every logit of the batch at once."""
    import torch

    assert isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor) and isinstance(targets, torch.Tensor)
    logits = torch.nn.functional.linear(hidden.float(), weight.float()) / 1.0
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        (-(logsm.exp() * logsm).sum(-1)).sum()
    logp.sum().backward()


def chunked_head(hidden: object, weight: object, targets: object) -> None:
    import torch

    from services.learner.head import head_logprobs

    assert isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor) and isinstance(targets, torch.Tensor)
    ones = torch.ones(hidden.shape[0])
    logp, _ = head_logprobs(hidden, weight, None, targets, ones, "fp32")
    logp.sum().backward()


def peak(head: object, tokens: int) -> int:
    import torch

    torch.manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, requires_grad=True) * 0.02
    weight = weight.detach().requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,))
    assert callable(head)
    return profiled_peak(lambda: head(hidden, weight, targets))


def peak_in_a_process(name: str, tokens: int) -> int:
    """``peak`` of head ``name`` at ``tokens``, measured in a process of its own (nothing of another
    measurement alive beside it)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.head", "--one", name, str(tokens)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    ).stdout
    return int(out.strip().splitlines()[-1])


def head_figure() -> Figure:
    per_token = {}
    peaks = {}
    for name in HEADS:
        low, high = (peak_in_a_process(name, t) for t in TOKENS)
        peaks[name] = {"tokens": list(TOKENS), "peak_bytes": [low, high]}
        per_token[name] = (high - low) / (TOKENS[1] - TOKENS[0])
    return Figure(
        name="learner_head_bytes_per_token_chunked_vs_whole",
        value=per_token["chunked"],
        unit="B",
        ratio=per_token["whole"] / per_token["chunked"],
        baseline=f"the whole head {per_token['whole'] / 1e6:.2f} MB a token",
        measured=f"peak tensor bytes a token of a forward and backward, vocabulary {VOCAB:,}, width {HIDDEN}, "
        f"slope between {TOKENS[0]} and {TOKENS[1]} tokens",
        targets=(Target(of="ratio", direction="at least", bound=TARGET, rule="whole / chunked"),),
        details=peaks,
    )


HEADS = {"whole": whole_head, "chunked": chunked_head}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.head", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help=f"directory for {BENCH_FILE_NAME}")
    parser.add_argument("--one", nargs=2, metavar=("HEAD", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        import torch

        torch.set_num_threads(1)
        print(peak(HEADS[args.one[0]], int(args.one[1])))
        return 0
    if args.output is None:
        parser.error("--output is required")
    args.output.mkdir(parents=True, exist_ok=True)
    write_and_print([head_figure()], args.output / BENCH_FILE_NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
