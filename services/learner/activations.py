"""Bytes a decoder-only model's training pass holds beyond its weights, from its ``config.json``.

Owns reading a Hugging Face ``config.json`` (Llama, Qwen2, Qwen3) into the
shape the arithmetic needs (``ModelShape``: widths, parameter counts, KV
elements a token) and the bytes one micro-batch's forward and backward
hold: what autograd saves for the backward, tensor by tensor, in the
learner's own forward (``model.PolicyForward``) over transformers' Llama,
Qwen2 and Qwen3 layers, what activation checkpoints hold instead, and the
FP32 LM head's logits. Pure arithmetic, no torch; ``plan`` builds a rank's,
a generator's and a pod's figures on it. tests/learner/test_plan.py
measures these figures on the CPU for each family (saved-tensor hooks, and
the peak of live tensors over a forward and backward), in the CPU learner's
configuration and under the GPU learner's numerics (FSDP2, bf16, SDPA).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from asymptote.errors import ConfigError

FLOAT32 = 4
HEAD_CHUNK_BYTES = 256 * 1024 * 1024
"""The float32 logits of one chunk of tokens in the LM head (services.learner.head): its working set is a few
times this, whatever the batch."""


def chunk_rows(vocab_size: int, chunk_bytes: int = HEAD_CHUNK_BYTES) -> int:
    """Tokens whose float32 logits fit ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


INT64 = 8
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the floating dtypes a model computes, is served or is stored in."""
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
Attention = Literal["sdpa", "eager"]


@dataclass(frozen=True)
class ModelShape:
    """What the memory arithmetic needs from a decoder-only model's ``config.json``."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """Biases on q/k/v (Qwen2 always; Llama and Qwen3 with attention_bias)."""
    o_bias: bool
    """A bias on o_proj (Llama and Qwen3 with attention_bias)."""
    mlp_bias: bool
    """Biases on the MLP's three projections (Llama's mlp_bias)."""
    qk_norm: bool
    """RMSNorms on each head's queries and keys (Qwen3)."""
    stored_dtype: str
    """Dtype of the checkpoint's tensors (config.json's dtype): the dtype the learner serves."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "config.json") -> ModelShape:
        """The shape ``config`` describes; ConfigError naming ``source`` and the field at fault."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r}; the planner knows {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def count(name: str, default: int | None = None) -> int:
            value = config.get(name)
            value = default if value is None else value
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{source}: {name} must be a positive integer, got {config.get(name)!r}")
            return value

        hidden, heads = count("hidden_size"), count("num_attention_heads")
        attention_bias = bool(config.get("attention_bias", False))
        stored = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
        return cls(
            model_type=str(model_type),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_layers=count("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=count("num_key_value_heads", heads),
            head_dim=count("head_dim", hidden // heads),
            vocab_size=count("vocab_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            stored_dtype=stored if stored in DTYPE_BYTES else "bfloat16",
        )

    @classmethod
    def read(cls, model_dir: Path) -> ModelShape:
        """The shape of the model in ``model_dir``; ConfigError when its config.json is absent or unreadable."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json here (not a Hugging Face model directory)")
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: not readable JSON ({exc})") from exc
        if not isinstance(config, dict):
            raise ConfigError(f"{path}: must hold a JSON object")
        return cls.from_config(config, str(path))

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_parameters(self) -> int:
        """One decoder layer's: attention, MLP, two RMSNorms (and Qwen3's q/k norms)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_width, self.kv_width
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        return attention + mlp + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def root_parameters(self) -> int:
        """Outside the decoder layers (FSDP2's root group): embeddings, final norm, an untied LM head."""
        embedding = self.vocab_size * self.hidden_size
        return embedding + self.hidden_size + (0 if self.tie_word_embeddings else embedding)

    @property
    def num_parameters(self) -> int:
        return self.num_layers * self.layer_parameters + self.root_parameters

    @property
    def largest_tensor_elements(self) -> int:
        h = self.hidden_size
        return max(self.vocab_size * h, self.intermediate_size * h, self.q_width * h)

    @property
    def kv_bytes_per_token_element(self) -> int:
        """K and V elements a token leaves in a KV cache, over all layers (times the cache dtype's bytes)."""
        return 2 * self.num_layers * self.kv_width


@dataclass(frozen=True)
class Activations:
    """Bytes of one micro-batch's forward and backward beyond the weights.

    ``kept``: what the forward leaves for the backward (autograd's saved
    tensors, and with activation checkpointing the layers' inputs the
    checkpoints hold), the LM head's logits aside. ``head``: the FP32 head's
    [positions, vocab] float32 tensors at their peak. ``recomputed``: one
    layer's saved tensors, rebuilt in the backward under activation
    checkpointing (after the head's backward, so the peak has the larger of
    ``head`` and ``recomputed``).
    """

    kept: int
    head: int
    recomputed: int
    head_saved: int
    """What the head saves for its backward beyond its input (targets, inverse temperatures), for the
    measured comparison."""

    @property
    def peak(self) -> int:
        return self.kept + max(self.head, self.recomputed)


def layer_bytes_per_token(
    shape: ModelShape, *, width_tokens: int, compute_bytes: int, attention: Attention, fsdp: bool
) -> int:
    """Bytes one decoder layer saves for its backward per token of a micro-batch whose rows are
    ``width_tokens`` wide, as transformers' Llama/Qwen2/Qwen3 layers run under the learner.

    ``compute_bytes``: 4 (float32, the CPU learner) or 2 (bf16). ``fsdp``:
    FSDP2's mixed precision casts a layer's weights and floating inputs to
    bf16 once (the residual stream between layers is then bf16); without it
    (one rank, DDP) the weights stay float32 and autocast casts per op, so
    the residual stream stays float32 and each projection casts its input.
    """
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_width, shape.kv_width
    c = compute_bytes
    autocast = c < FLOAT32 and not fsdp
    residual = c if c < FLOAT32 and fsdp else FLOAT32

    def rms_norm(readers: int) -> int:
        # HF's RMSNorm computes in float32: its float32 input (the residual itself when that is float32),
        # 1/rms, the normalised x in the input's dtype (kept for the weight's gradient), and the output the
        # projections read: under autocast one bf16 cast per projection reading it.
        return FLOAT32 * h + FLOAT32 + residual * h + c * h * (readers if autocast else 1)

    total = rms_norm(3) + rms_norm(2)  # q, k, v read the first; gate and up the second
    if shape.qk_norm:
        # Qwen3's per-head norms of q and k: float32 copies, 1/rms per head, normalised in bf16.
        total += FLOAT32 * (q + kv) + FLOAT32 * (shape.num_heads + shape.num_kv_heads) + c * (q + kv)
    # Queries, keys and values at every head (transformers repeats the KV heads whenever a mask is given),
    # and the attention's output, which o_proj reads.
    total += 4 * c * q
    if attention == "sdpa":
        # Log-sum-exp per head (float32), and the additive mask SDPA makes from the boolean one in every
        # call: [rows, 1, T, T] in bf16, T per token: quadratic in the row's width.
        total += FLOAT32 * shape.num_heads + c * width_tokens
    else:
        # Eager attention: softmax probabilities [rows, heads, T, T] in float32, and their cast for the
        # matmul with V when computing in bf16.
        total += shape.num_heads * width_tokens * (FLOAT32 + (c if c < FLOAT32 else 0))
    total += 4 * c * i  # the MLP: gate and up outputs, SiLU(gate), down's input
    if c < FLOAT32 and fsdp:
        total += 2 * shape.head_dim * c  # RoPE's cos and sin, cast into every layer by FSDP2
    return total


def activation_bytes(
    shape: ModelShape,
    *,
    tokens: int,
    width_tokens: int,
    completion_positions: int,
    compute_bytes: int,
    attention: Attention,
    fsdp: bool,
    checkpointing: bool,
) -> Activations:
    """A micro-batch of ``tokens`` padded tokens in rows ``width_tokens`` wide, of which
    ``completion_positions`` go through the LM head (see ``layer_bytes_per_token`` for the rest)."""
    c = compute_bytes
    cast_layers = c < FLOAT32 and fsdp
    residual = c if cast_layers else FLOAT32
    h, d = shape.hidden_size, shape.head_dim
    layer = tokens * layer_bytes_per_token(
        shape, width_tokens=width_tokens, compute_bytes=c, attention=attention, fsdp=fsdp
    )
    outside = tokens * INT64  # the input ids the embedding saves (the head's targets are a view of them)
    outside += tokens * (FLOAT32 * h + FLOAT32 + residual * h)  # the final norm
    if not cast_layers:
        outside += tokens * 2 * d * FLOAT32  # RoPE's cos and sin, shared by every layer
    outside += completion_positions * FLOAT32 * h  # the head's float32 input, copied out of the sliced hidden states
    if checkpointing:
        # Each checkpoint holds its layer's inputs: the hidden states (and the RoPE tables FSDP2 cast for it),
        # and, shared, the position ids and the 4D mask (boolean for SDPA, float32 for eager attention).
        held = shape.num_layers * tokens * (residual * h + (2 * d * c if cast_layers else 0))
        held += tokens * INT64
        if attention == "eager" and cast_layers:
            held += shape.num_layers * tokens * width_tokens * c
        else:
            held += tokens * width_tokens * (1 if attention == "sdpa" else FLOAT32)
        kept, recomputed = outside + held, layer
    else:
        kept, recomputed = outside + shape.num_layers * layer, 0
    # The head (services.learner.head) keeps each completion position's target and inverse temperature
    # besides its input; its logits live one chunk of HEAD_CHUNK_BYTES at a time. At its forward peak a
    # chunk's log-softmax, its exp and their product for the entropy (the logits are freed once the
    # log-softmax is made): three float32 [rows, vocab]. The backward recomputes the logits and takes the
    # softmax and its gradient in place: two.
    saved = completion_positions * (INT64 + FLOAT32)
    rows = min(completion_positions, chunk_rows(shape.vocab_size))
    head = 3 * rows * shape.vocab_size * FLOAT32
    return Activations(kept=kept, head=head, recomputed=recomputed, head_saved=saved)
