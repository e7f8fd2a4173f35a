"""The tiny local policy: a character tokenizer and a small Llama.

Owns how the embedded default's model directory is made and read: a
character-level tokenizer built with the ``tokenizers`` library (one token per
character of the task's alphabet plus ``<pad>``, ``<bos>``, ``<eos>``,
``<unk>``, padded with ``<reserved_k>`` specials to a round vocabulary size so
that every id the model can sample decodes), a float32 ``LlamaForCausalLM`` sized by ``ModelSpec``, and the
directory layout both transformers and vLLM load (``config.json``,
``model.safetensors``, ``generation_config.json``, tokenizer files), and the
two inference primitives training needs: per-token log-probs of given
completions, and batched sampling with a KV cache. Knows nothing about
losses or optimisers; ``warmstart`` and ``onpolicy`` build on it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import Field, model_validator
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from asymptote.config import Frozen

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


def save_model_dir(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> Path:
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


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(model_dir: Path) -> LlamaForCausalLM:
    """The float32 model in ``model_dir`` (eager attention: exact, and fastest at this size)."""
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    return model.float()


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class PackedBatch:
    """Prompts left-padded to a common length L, completions right-padded to T.

    Row n is ``[pad.. prompt_n completion_n pad..]``; with ``position_ids``
    counting from the first real token, each row sees exactly what an
    unpadded run (vLLM) sees.
    """

    input_ids: torch.Tensor
    """[N, L + T] token ids."""
    attention_mask: torch.Tensor
    """[N, L + T] 1 on real tokens."""
    position_ids: torch.Tensor
    """[N, L + T] position of each token in its own unpadded sequence."""
    prompt_len: int
    """L, the padded prompt length."""
    completion_mask: torch.Tensor
    """[N, T] 1 on real completion tokens."""


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> PackedBatch:
    """Lay out prompt and completion token ids for one forward pass (see PackedBatch)."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"need as many prompts as completions (>0), got {len(prompts)} and {len(completions)}")
    prompt_ids, prompt_mask = _left_pad(prompts, pad_id)
    width = max(1, max(len(c) for c in completions))
    comp_ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    comp_mask = torch.zeros((len(completions), width), dtype=torch.long)
    for i, c in enumerate(completions):
        comp_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        comp_mask[i, : len(c)] = 1
    mask = torch.cat([prompt_mask, comp_mask], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp_min(0)
    return PackedBatch(
        input_ids=torch.cat([prompt_ids, comp_ids], dim=1),
        attention_mask=mask,
        position_ids=positions,
        prompt_len=prompt_ids.shape[1],
        completion_mask=comp_mask,
    )


def completion_logprobs(model: LlamaForCausalLM, batch: PackedBatch, temperature: float = 1.0) -> torch.Tensor:
    """[N, T] log-prob of each completion token under ``model`` (0 where masked).

    Computed in float32 from logits divided by ``temperature`` (the
    sampling distribution). Differentiable; call under no_grad for scoring.
    """
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    # Logits at position L-1+t predict completion token t.
    logits = out.logits[:, batch.prompt_len - 1 : -1].float() / temperature
    targets = batch.input_ids[:, batch.prompt_len :]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return logp * batch.completion_mask


@dataclass(frozen=True)
class Samples:
    """Completions sampled from a batch of prompts."""

    completions: list[list[int]]
    """Token ids of each completion, ending with EOS unless truncated."""
    logprobs: list[list[float]]
    """Sampling log-prob of each completion token (at the sampling temperature)."""
    truncated: list[bool]
    """True where max_new_tokens ran out before EOS."""


@torch.no_grad()
def sample(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> Samples:
    """Sample one completion per prompt row (repeat rows for a group), KV-cached.

    Full-vocabulary sampling (no top-k/top-p), as the RL recipe assumes.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    ids, mask = _left_pad(prompts, pad_id)
    positions = (mask.cumsum(dim=1) - 1).clamp_min(0)
    n = len(prompts)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache = out.past_key_values
    logits = out.logits[:, -1].float()
    next_pos = positions[:, -1:] + 1
    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    alive = torch.ones(n, dtype=torch.bool)
    lengths = torch.zeros(n, dtype=torch.long)
    for _ in range(max_new_tokens):
        logp_all = torch.log_softmax(logits / temperature, dim=-1)
        tok = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(1)
        tokens.append(tok)
        logps.append(logp_all.gather(1, tok[:, None]).squeeze(1))
        lengths += alive.long()
        alive &= tok != eos_id
        if not alive.any():
            break
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype)], dim=1)
        out = model(
            input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=cache, use_cache=True
        )
        cache = out.past_key_values
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    tok_mat = torch.stack(tokens, dim=1).tolist()
    logp_mat = torch.stack(logps, dim=1).tolist()
    lens = lengths.tolist()
    return Samples(
        completions=[row[:k] for row, k in zip(tok_mat, lens)],
        logprobs=[row[:k] for row, k in zip(logp_mat, lens)],
        truncated=[bool(a) for a in alive.tolist()],
    )
