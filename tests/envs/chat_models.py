"""Tokenizers and tiny models with tool-using chat templates, built here (nothing comes from a hub).

Two templates in the formats real models use: Qwen3's, which every
tokenizer the project trains carries (``CHAT_TEMPLATE`` in
services/embedded/build.py: tools in the system message, ``<tool_call>``
calls, tool results as ``<tool_response>`` blocks in a user turn,
``<think>`` blocks kept only after the last user query, an empty think
block on a last assistant turn), and Llama 3's, written here (a BOS,
header tokens, ``<|eot_id|>`` ends a turn, tool results under the
``ipython`` role). Both render message contents verbatim, as the real
ones do for text without think blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedTokenizerFast

from services.embedded.build import (
    ModelSpec,
    build_model,
    save_model_dir,
    train_bpe_tokenizer,
    word_problem_corpus,
)

LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n"
    'Call a function by answering with {"name": function name, "parameters": arguments}:\\n\' }}'
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message.role == 'tool' else message.role %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '{\"name\": \"' + call.function.name + '\", \"parameters\": ' + (call.function.arguments | tojson) + '}' }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama 3's chat format (see the module docstring)."""

Flavour = Literal["qwen3", "llama"]


def chat_tokenizer(flavour: Flavour) -> PreTrainedTokenizerFast:
    """The test BPE tokenizer with ``flavour``'s chat template (and, for llama, its special tokens)."""
    tok = train_bpe_tokenizer(word_problem_corpus(), 512)
    if flavour == "qwen3":
        return tok  # the project's tokenizers carry Qwen3's template already
    tok.add_special_tokens({"additional_special_tokens": list(LLAMA3_SPECIALS)})
    tok.bos_token = "<|begin_of_text|>"
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


EOS_FEATURE = 0.3
"""The end token's weight on the constant feature (about +3.3 logits): most turns end by themselves
within ten tokens, some run into their token limit."""


def chat_model_dir(flavour: Flavour, out: Path) -> Path:
    """A tiny random model (Qwen3 or Llama) with ``flavour``'s tokenizer, saved to ``out``.

    Shaped so that a turn's text renders verbatim: a constant feature in
    every embedding lets the LM head rule out every special or added token
    but the end token (no think blocks, no headers mid-turn) and every
    token that decodes to part of a UTF-8 character, and makes the end
    token likely (turns of a few tokens, both ended and cut).
    """
    tok = chat_tokenizer(flavour)
    spec = ModelSpec(
        family="qwen3" if flavour == "qwen3" else "llama",
        tie_word_embeddings=False,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64 if flavour == "qwen3" else None,
        max_position_embeddings=1024,
        init_seed=3,
    )
    net = build_model(spec, tok)
    special = {*tok.all_special_ids, *(tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))}
    with torch.no_grad():
        net.model.embed_tokens.weight[:, 0] = 1.0
        head = net.lm_head.weight
        head[:, 0] = 0.0
        for i in range(len(tok)):
            if i == tok.eos_token_id:
                head[i, 0] = EOS_FEATURE
            elif i in special or "\ufffd" in tok.decode([i]):
                head[i, 0] = -2.0
    return save_model_dir(net, tok, out)
