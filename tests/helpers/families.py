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


QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "torch_dtype": "bfloat16",
}
"""Qwen3-8B's config.json (Qwen/Qwen3-8B on the hub): planning needs its shape, never its weights."""


def config_only(out: Path, config: dict[str, Any]) -> Path:
    """A model directory ``out`` holding only ``config``'s config.json: what planning reads, and no weights."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    return out
