"""Small random-initialised models of the architectures the system is tested on, with the task's tokenizer.

Llama with an untied head, Qwen2 (attention biases) with a tied head, Qwen3
(q/k norms, its own head size) with an untied head: each built by
``services.embedded.build`` (the one place that names architectures), with
the arithmetic task's character tokenizer so that the task's prompts and
verifier work unchanged. Models with a BPE tokenizer and a chat template come
from ``build.create_test_model_dir``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.qwen3_8b import QWEN3_8B as QWEN3_8B  # the planner's tests read it from here

TIED = {"llama": False, "qwen2": True, "qwen3": False}


def build(family: str, out: Path) -> Path:
    """A small random model of ``family`` with the arithmetic task's character tokenizer."""
    from asymptote.tasks import ALPHABET
    from services.embedded.build import ModelSpec, build_model, build_tokenizer, save_model_dir

    tok = build_tokenizer(ALPHABET)
    spec = ModelSpec.model_validate(
        {
            "family": family,
            "tie_word_embeddings": TIED[family],
            "num_kv_heads": 2,
            # Qwen3's head size is its own, not hidden_size / num_heads (32).
            "head_dim": 64 if family == "qwen3" else None,
        }
    )
    return save_model_dir(build_model(spec, tok), tok, out)


def config_only(out: Path, config: dict[str, Any]) -> Path:
    """A model directory ``out`` holding only ``config``'s config.json: what planning reads, and no weights."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    return out
