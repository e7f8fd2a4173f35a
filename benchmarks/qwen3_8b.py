"""Qwen3-8B's config.json: the shape the benchmarks' figures at 8B, the planner's tests and the sizing tests read.

Owns that one description of the model (Qwen/Qwen3-8B on the hub); its weights are never needed, so
nothing here is downloaded. Torch-free.
"""

from __future__ import annotations

from typing import Any

QWEN3_8B: dict[str, Any] = {
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
