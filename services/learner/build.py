"""Building a random-initialised model directory: the embedded default's model.

Owns how a model directory is made from nothing: a character-level
tokenizer built with the ``tokenizers`` library (one token per character of
the task's alphabet plus ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``, padded
with ``<reserved_k>`` specials to a round vocabulary size so that every id
the model can sample decodes), a float32 causal LM sized by ``ModelSpec``,
and the directory layout both transformers and vLLM load (``config.json``,
``model.safetensors``, ``generation_config.json``, tokenizer files). A
directory built here is read back by ``services.learner.model`` like any
user's Hugging Face model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from pydantic import Field, model_validator
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from asymptote.config import Frozen
from services.learner.model import count_parameters

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

# Head sizes vLLM's CPU attention backend implements (CPU_ATTN); a model with
# another head size loads in transformers but not in the generator.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class ModelSpec(Frozen):
    """Shape of the tiny Llama; the vocabulary comes from the task's alphabet."""

    hidden_size: int = Field(default=128, ge=32)
    """Width of the residual stream."""
    num_layers: int = Field(default=2, ge=1)
    """Transformer blocks."""
    num_heads: int = Field(default=4, ge=1)
    """Attention heads (head size = hidden_size / num_heads, one of VLLM_CPU_HEAD_SIZES)."""
    intermediate_size: int = Field(default=256, ge=1)
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = Field(default=64, ge=8)
    """Longest prompt plus completion, in tokens."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the LM head (halves the embedding parameters)."""
    vocab_multiple: int = Field(default=16, ge=1)
    """Vocabulary padded with reserved special tokens up to a multiple of this."""
    init_seed: int = 0
    """Seed of the random initialisation."""

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        head = self.hidden_size // self.num_heads
        if head not in VLLM_CPU_HEAD_SIZES:
            raise ValueError(f"head size {head} is not supported by vLLM on CPU; use one of {VLLM_CPU_HEAD_SIZES}")
        return self


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


def build_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A freshly initialised float32 Llama for ``tokenizer``'s vocabulary."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed)
        model = LlamaForCausalLM(config)
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
    """Build tokenizer and randomly initialised model, save them to ``out_dir``."""
    tokenizer = build_tokenizer(alphabet, spec.vocab_multiple)
    model = build_model(spec, tokenizer)
    log.info("built %s-parameter Llama (%s) at %s", f"{count_parameters(model):,}", spec, out_dir)
    return save_model_dir(model, tokenizer, out_dir)
