"""Small random-initialised models of the architectures the system is tested on.

Llama with an untied head, Qwen2 (attention biases) with a tied head, Qwen3
(q/k norms, an explicit head size) with an untied head: each built from its
Hugging Face config, with the arithmetic task's character tokenizer so that
the task's prompts and verifier work unchanged. Head sizes are ones vLLM's
CPU attention implements.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3")


def build(family: str, out: Path) -> Path:
    """A small random model of ``family`` with the arithmetic task's character tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    from asymptote.tasks import ALPHABET
    from services.learner.build import build_tokenizer, save_model_dir

    tok = build_tokenizer(ALPHABET)
    common: dict[str, Any] = {
        "vocab_size": len(tok),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    config = {
        "llama": lambda: LlamaConfig(**common, tie_word_embeddings=False),
        "qwen2": lambda: Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": lambda: Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
    }[family]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return save_model_dir(model, tok, out)
