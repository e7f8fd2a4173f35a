"""Building a random-initialised model directory: the embedded default's model, and test models.

Owns how a model directory is made from nothing: a character-level
tokenizer built with the ``tokenizers`` library (one token per character of
the task's alphabet plus ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``, padded
with ``<reserved_k>`` specials to a round vocabulary size so that every id
the model can sample decodes), or a byte-level BPE tokenizer trained here
on a small generated corpus, with ChatML special tokens and a chat template
like Qwen's; a float32 causal LM of one of a few Hugging Face families
(Llama, Qwen2, Qwen3, and Qwen3-MoE: a mixture of experts with a dense
first layer) sized by ``ModelSpec``; and the directory layout both
transformers and vLLM load (``config.json``, ``model.safetensors``,
``generation_config.json``, tokenizer files). This is the one module that
names architectures: a directory built here is read back by
``services.learner.model`` like any user's Hugging Face model.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from pydantic import Field, model_validator
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from asymptote.config import Frozen
from services.learner.model import count_parameters

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

# Head sizes vLLM's CPU attention backend implements (CPU_ATTN); a model with
# another head size loads in transformers but not in the generator.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# vLLM's CPU fused-MoE kernels take a residual stream whose width is a multiple of this.
VLLM_CPU_MOE_HIDDEN_MULTIPLE = 32

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]
FAMILIES: tuple[Family, ...] = get_args(Family)

_CONFIG_CLASSES: dict[Family, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,  # q/k/v projections with biases
    "qwen3": Qwen3Config,  # q/k RMSNorms, head size set apart from hidden_size / num_heads
    "qwen3_moe": Qwen3MoeConfig,  # Qwen3's attention, a routed mixture of experts in place of the MLP
}


class ModelSpec(Frozen):
    """Shape of a small causal LM; the vocabulary comes from the tokenizer."""

    family: Family = "llama"
    """Hugging Face architecture: llama, qwen2 (attention biases), qwen3 (q/k norms, explicit head size) or
    qwen3_moe (Qwen3's attention, top-k routed experts in place of the MLP)."""
    hidden_size: int = Field(default=128, ge=32)
    """Width of the residual stream."""
    num_layers: int = Field(default=2, ge=1)
    """Transformer blocks."""
    num_heads: int = Field(default=4, ge=1)
    """Query heads."""
    num_kv_heads: int | None = Field(default=None, ge=1)
    """Key/value heads (grouped-query attention; divides num_heads); None: num_heads."""
    head_dim: int | None = Field(default=None, ge=1)
    """Head size, one of VLLM_CPU_HEAD_SIZES; None: hidden_size / num_heads (the only choice for qwen2)."""
    intermediate_size: int = Field(default=256, ge=1)
    """Width of the SwiGLU MLP (qwen3_moe: of its dense layers')."""
    num_experts: int = Field(default=8, ge=2)
    """qwen3_moe: routed experts per MoE layer."""
    num_experts_per_token: int = Field(default=2, ge=1)
    """qwen3_moe: experts each token is routed to (top-k)."""
    expert_intermediate_size: int = Field(default=64, ge=1)
    """qwen3_moe: width of each expert's SwiGLU MLP."""
    num_dense_layers: int = Field(default=1, ge=0)
    """qwen3_moe: the first layers keep a dense MLP (``mlp_only_layers``), the rest route to experts."""
    max_position_embeddings: int = Field(default=64, ge=8)
    """Longest prompt plus completion, in tokens."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the LM head (halves the embedding parameters)."""
    vocab_multiple: int = Field(default=16, ge=1)
    """Character vocabulary padded with reserved special tokens up to a multiple of this."""
    init_seed: int = 0
    """Seed of the random initialisation."""

    @property
    def head_size(self) -> int:
        """The head size the model is built with."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """The key/value heads the model is built with."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.family == "qwen2" and self.head_dim not in (None, self.hidden_size // self.num_heads):
            raise ValueError(
                f"qwen2 takes its head size from hidden_size / num_heads ({self.hidden_size // self.num_heads}), "
                f"got head_dim {self.head_dim}"
            )
        if self.head_size not in VLLM_CPU_HEAD_SIZES:
            raise ValueError(
                f"head size {self.head_size} is not supported by vLLM on CPU; use one of {VLLM_CPU_HEAD_SIZES}"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads {self.kv_heads} does not divide num_heads {self.num_heads}")
        if self.family == "qwen3_moe":
            if self.hidden_size % VLLM_CPU_MOE_HIDDEN_MULTIPLE:
                raise ValueError(
                    f"qwen3_moe hidden_size {self.hidden_size} is not a multiple of {VLLM_CPU_MOE_HIDDEN_MULTIPLE}, "
                    "which vLLM's CPU fused-MoE kernels need"
                )
            if self.num_experts_per_token > self.num_experts:
                raise ValueError(
                    f"num_experts_per_token {self.num_experts_per_token} exceeds num_experts {self.num_experts}"
                )
            if self.num_dense_layers >= self.num_layers:
                raise ValueError(
                    f"num_dense_layers {self.num_dense_layers} leaves no MoE layer in {self.num_layers} layers"
                )
        return self

    @property
    def moe_layers(self) -> list[int]:
        """The layers that route to experts (none for a dense family)."""
        return list(range(self.num_dense_layers, self.num_layers)) if self.family == "qwen3_moe" else []


def build_tokenizer(alphabet: str, vocab_multiple: int = 16) -> PreTrainedTokenizerFast:
    """Character tokenizer: specials get ids 0-3, then each character in alphabet order,
    then ``<reserved_k>`` specials up to a multiple of ``vocab_multiple``.

    Encoding prepends ``<bos>``; decoding concatenates characters with no
    separator, so ``decode(encode(s), skip_special_tokens=True) == s`` for any
    ``s`` over the alphabet.
    """
    chars = list(dict.fromkeys(alphabet))
    if not chars or any(len(c) != 1 or c.isspace() for c in chars):
        raise ValueError(f"alphabet must be non-empty printable characters without whitespace, got {alphabet!r}")
    num_real = len(SPECIAL_TOKENS) + len(chars)
    reserved = [f"<reserved_{k}>" for k in range(-(-num_real // vocab_multiple) * vocab_multiple - num_real)]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars, *reserved])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    # Reserved ids are special too: a model that samples one (it has a logit
    # row for it) yields text without it rather than a decoding error.
    core.add_special_tokens([*SPECIAL_TOKENS, *reserved])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        # Left padding: batched generation appends after the prompt.
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
THINK_TOKENS = ("<think>", "</think>")

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and not (message.content.startswith('<tool_response>')"
    " and message.content.endswith('</tool_response>')) %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \''
    " + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
"""Qwen3's chat format, as its models ship it: ``<|im_start|>role\ncontent<|im_end|>\n`` per message (ChatML),
then ``<|im_start|>assistant\n`` with ``add_generation_prompt`` (``enable_thinking=False`` adds an empty think
block); with ``tools``, their JSON schemas in the system message, calls as ``<tool_call>`` JSON and tool
results as ``<tool_response>`` blocks in a user turn (the Hermes format vLLM's ``hermes`` parser reads);
``<think>`` blocks of assistant turns kept only after the last user query. Message contents render verbatim."""


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, min_frequency: int = 2, vocab_multiple: int = 64
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``, with ChatML specials and Qwen3's chat template.

    ``len(tokenizer) == vocab_size``, a multiple of ``vocab_multiple``. Ids 0-2
    are ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos); then
    the 256 byte symbols and the learnt merges; then ``<think>``/``</think>``
    (added, not special: they survive ``skip_special_tokens``), then
    ``<|reserved_k|>`` specials filling the vocabulary when the corpus yields
    fewer merges (every id the model can sample decodes). Byte-level with no
    normaliser: ``decode(encode(s)) == s`` for any text, and no BOS is
    added. Deterministic for the same texts.
    """
    num_fixed = len(CHAT_SPECIAL_TOKENS) + len(THINK_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size % vocab_multiple or vocab_size <= num_fixed:
        raise ValueError(f"vocab_size must be a multiple of {vocab_multiple} above {num_fixed}, got {vocab_size}")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS),
        min_frequency=min_frequency,
        special_tokens=list(CHAT_SPECIAL_TOKENS),
        # Every byte is in the vocabulary whether or not the corpus has it: any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    core.add_special_tokens([f"<|reserved_{k}|>" for k in range(vocab_size - core.get_vocab_size())])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


_NAMES = ("Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "June")
_THINGS = ("apples", "books", "coins", "eggs", "marbles", "pencils", "stamps", "tickets")


def word_problem_corpus(num_problems: int = 2000, seed: int = 0) -> list[str]:
    """Generated arithmetic word problems with worked answers, in chat roles: the BPE training text."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_problems):
        name, other, thing = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_THINGS)
        a, b = rng.randint(2, 999), rng.randint(1, 99)
        op = rng.choice(("+", "-", "*"))
        if op == "+":
            story, result = f"{name} has {a} {thing}. {other} gives {name} {b} more.", a + b
        elif op == "-":
            a = max(a, b)
            story, result = f"{name} has {a} {thing} and gives {b} of them to {other}.", a - b
        else:
            story, result = f"{name} buys {b} boxes of {thing} with {a} in each box.", a * b
        out.append(
            f"user\n{story} How many {thing} does {name} have now?\n"
            f"assistant\nWe compute {a} {op} {b} = {result}. The answer is {result}.\n"
        )
    return out


def model_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The Hugging Face config of ``spec.family`` for ``tokenizer``'s vocabulary and special tokens."""
    fields: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": "float32",
    }
    if spec.family != "qwen2":  # Qwen2Config has no head_dim: it is always hidden_size / num_heads
        fields["head_dim"] = spec.head_size
    if spec.family == "qwen3_moe":
        fields |= {
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_token,
            "moe_intermediate_size": spec.expert_intermediate_size,
            "mlp_only_layers": list(range(spec.num_dense_layers)),
            "decoder_sparse_step": 1,
            # The released Qwen3-MoE models renormalise the top-k gate weights; the config class defaults to not.
            "norm_topk_prob": True,
            "sliding_window": None,
            "use_sliding_window": False,
        }
    return _CONFIG_CLASSES[spec.family](**fields)


def build_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A freshly initialised float32 causal LM of ``spec.family`` for ``tokenizer``'s vocabulary."""
    config = model_config(spec, tokenizer)
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.float()


def generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    # Only the token ids: vLLM takes sampling defaults from this file, and the
    # RL sampler sets temperature and top-k itself.
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> Path:
    """Write a model directory loadable by transformers and vLLM."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def create_model_dir(spec: ModelSpec, alphabet: str, out_dir: Path) -> Path:
    """Build the character tokenizer and a randomly initialised model, save them to ``out_dir``."""
    tokenizer = build_tokenizer(alphabet, spec.vocab_multiple)
    model = build_model(spec, tokenizer)
    log.info("built %s-parameter %s (%s) at %s", f"{count_parameters(model):,}", spec.family, spec, out_dir)
    return save_model_dir(model, tokenizer, out_dir)


TEST_VOCAB_SIZE = 512
"""BPE vocabulary of test models: the 256 bytes, a few hundred merges, the specials."""


def create_test_model_dir(
    family: Family,
    tie_word_embeddings: bool,
    out_dir: Path,
    *,
    vocab_size: int = TEST_VOCAB_SIZE,
    texts: Iterable[str] | None = None,
    **shape: Any,
) -> Path:
    """A small random model of ``family`` with a BPE tokenizer and ChatML template, saved to ``out_dir``.

    The tokenizer is trained on ``texts`` (default: ``word_problem_corpus()``,
    well under a second). The shape has grouped-query attention (4 query
    heads, 2 key/value heads) and, for qwen3 and qwen3_moe, a head size other
    than hidden_size / num_heads, as real Qwen3 models have; qwen3_moe has
    ``ModelSpec``'s 8 experts, top-2, and a dense first layer. ``shape``
    overrides any ``ModelSpec`` field.
    """
    fields: dict[str, Any] = {
        "family": family,
        "tie_word_embeddings": tie_word_embeddings,
        "hidden_size": 128,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 64 if family in ("qwen3", "qwen3_moe") else None,
        "max_position_embeddings": 256,
    }
    spec = ModelSpec(**{**fields, **shape})
    tokenizer = train_bpe_tokenizer(word_problem_corpus() if texts is None else texts, vocab_size)
    model = build_model(spec, tokenizer)
    log.info("built %s-parameter %s (%s) at %s", f"{count_parameters(model):,}", family, spec, out_dir)
    return save_model_dir(model, tokenizer, out_dir)


def cast_model_dir(model_dir: Path, dtype: torch.dtype) -> Path:
    """Store ``model_dir``'s floating-point weights in ``dtype`` (e.g. a bf16 checkpoint, as hubs ship them)."""
    import json

    from safetensors.torch import load_file, save_file

    for file in model_dir.glob("*.safetensors"):
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(file)).items()}
        save_file(tensors, str(file), metadata={"format": "pt"})
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return model_dir
