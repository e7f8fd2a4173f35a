"""Attention over sequences packed end to end: each token sees only its own sequence, no padding anywhere.

Owns the attention the learner's model computes when ``PolicyForward``
packs a micro-batch's completions into one row (``PACKED``, registered
with transformers' ``AttentionInterface``): the row's sequences are given
by their cumulative lengths (``cu_seq_lens_q``, transformers' own keyword
for variable-length attention), and attention stays causal inside each.

- On a GPU, in bf16 or fp16: PyTorch's variable-length flash attention
  (``torch.nn.attention.varlen.varlen_attn``), one kernel for the row, no
  mask and no padding.
- Elsewhere (the CPU, float32): each sequence laid in a row of its own,
  right-padded, and scaled dot-product attention over the rows, causal; the
  same numbers a padded batch gives, since with a causal mask a real token
  never attends to the padding after it. Only attention sees the padding:
  the rest of the model computes real tokens alone.

A call without the sequences' lengths (a padded batch, sampling with a KV
cache, a reference loop) is computed as transformers' SDPA computes it,
with the padding mask it would build; so a model switched to ``PACKED``
still scores padded rows exactly.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

PACKED = "asymptote_packed"
"""The attention implementation's name in transformers' registry."""


@functools.cache
def _flash_varlen() -> tuple[Callable[..., Any], dict[str, Any], bool] | None:
    """torch's varlen flash attention, the keywords that make it causal, and whether it takes GQA as is.

    None where this torch has none. Its signature changed between releases
    (``is_causal`` before ``window_size``), so the keywords are read from it.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


def sequence_lengths(lengths: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """The keywords a packed forward passes down to every attention layer, from each sequence's length.

    Besides transformers' own (cumulative lengths, the longest), where each
    token sits in a right-padded ``[sequences, longest]`` layout
    (``asy_padded_index``), for attention without the flash kernel.
    """
    lengths = lengths.to(torch.long)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    longest = int(lengths.max())
    row = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    column = torch.arange(int(lengths.sum())) - torch.repeat_interleave(cu[:-1].to(torch.long), lengths)
    cu = cu.to(device)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        "asy_padded_index": (row * longest + column).to(device),
        "asy_num_sequences": lengths.numel(),
    }


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``[1, heads, S, dim]`` query, key and value of one packed row -> ``[1, S, heads, dim]``, causal per sequence."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:  # not packed: as transformers' SDPA, with the mask _padding_mask made
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1 or attention_mask is not None:
        raise RuntimeError(f"packed attention takes one row and no mask, got {query.shape[0]} rows")
    if dropout:
        raise RuntimeError("packed attention has no dropout")
    if kwargs.get("sliding_window"):
        raise RuntimeError("packed attention has no sliding window; use the padded layout (packing: false)")
    flash = _flash_varlen()
    dtype = query.dtype
    if query.is_cuda and dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")  # a float32 norm (Qwen3's q/k norms) in a bf16 body
    if flash is not None and query.is_cuda and dtype in (torch.bfloat16, torch.float16):
        varlen_attn, causal, takes_gqa = flash
        q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # [S, heads, dim]
        extra: dict[str, Any] = dict(causal)
        if takes_gqa:
            extra["enable_gqa"] = q.shape[1] != k.shape[1]
        elif q.shape[1] != k.shape[1]:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        longest = int(kwargs["max_length_q"])
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **extra)
        return out[None], None
    # Each sequence in its own row, right-padded: with a causal mask a real token attends only to the real
    # tokens before it in its row, so the padding after them changes nothing they compute.
    index, rows, longest = kwargs["asy_padded_index"], int(kwargs["asy_num_sequences"]), int(kwargs["max_length_q"])

    def padded(t: torch.Tensor) -> torch.Tensor:  # [1, heads, S, dim] -> [rows, heads, longest, dim]
        out = t.new_zeros(t.shape[1], rows * longest, t.shape[3])
        out[:, index] = t[0]
        return out.view(t.shape[1], rows, longest, t.shape[3]).transpose(0, 1)

    out = F.scaled_dot_product_attention(
        padded(query),
        padded(key),
        padded(value),
        is_causal=True,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    heads, dim = out.shape[1], out.shape[3]
    flat = out.transpose(0, 1).reshape(heads, rows * longest, dim)[:, index]  # [heads, S, dim]
    return flat.transpose(0, 1)[None].contiguous(), None


def use_packed_attention(model: Any) -> None:
    """Switch ``model`` (a transformers model) to ``PACKED`` attention, registering it first."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED, packed_attention)
    AttentionMaskInterface.register(PACKED, _padding_mask)
    model.set_attn_implementation(PACKED)


def _padding_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask for a packed row (its sequences' lengths say it all); SDPA's for a padded batch."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    mask: torch.Tensor | None = sdpa_mask(*args, **kwargs)
    return mask


def has_sliding_window(config: Any) -> bool:
    """Whether any layer of a transformers config attends through a sliding window."""
    types = getattr(config, "layer_types", None)
    if types:
        return "sliding_attention" in types
    return bool(getattr(config, "sliding_window", None)) and bool(getattr(config, "use_sliding_window", True))


def is_packed(model: Any) -> bool:
    """Whether ``model`` computes packed rows (``use_packed_attention``)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == PACKED
