"""Model directories built from nothing: every family, tied and untied, with a locally trained BPE tokenizer.

A mixture of experts is stored as the released models are, one tensor per
expert, and read into transformers' fused expert tensors.

Each directory must load strictly through the Auto classes (no weight
either side lacks), hold exactly the parameters transformers counts (a tied
head once), load every tensor's values (checked after the file's values are
perturbed, so a tensor left at its initial value cannot pass), tokenize any
text reversibly, and render ChatML through its saved chat template.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.core_model_loading import revert_weight_conversion

from asymptote.codec import count_stored_parameters
from asymptote.tasks import ALPHABET
from services.embedded.build import (
    CHAT_SPECIAL_TOKENS,
    FAMILIES,
    THINK_TOKENS,
    ModelSpec,
    build_model,
    build_tokenizer,
    create_test_model_dir,
    train_bpe_tokenizer,
    word_problem_corpus,
)
from services.learner.model import count_parameters, load_model

VARIANTS = [(family, tied) for family in FAMILIES for tied in (True, False)]


@pytest.fixture(scope="module", params=VARIANTS, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in VARIANTS])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, tied = request.param
    return create_test_model_dir(family, tied, tmp_path_factory.mktemp("models") / f"{family}-{tied}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """The test models' tokenizer as a user's code reads it back from a directory."""
    out = create_test_model_dir("qwen3", False, tmp_path_factory.mktemp("tok") / "m")
    return AutoTokenizer.from_pretrained(str(out))


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def test_directory_loads_strictly_with_its_parameters_counted_once(model_dir: Path) -> None:
    model = load_model(model_dir)  # ModelError on any weight either side lacks
    tensors = checkpoint(model_dir)
    assert count_parameters(model) == sum(t.numel() for t in tensors.values())
    assert count_stored_parameters(model_dir) == count_parameters(model)  # read from the files, no torch
    tied = model.config.tie_word_embeddings
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert (head.weight is embed.weight) == tied
    # A tied head is not in the file at all (its embedding is); an MoE's experts are stored one by one.
    assert len(tensors) == len(revert_weight_conversion(model, model.state_dict())) - (1 if tied else 0)
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(str(model_dir)))


def test_every_tensor_is_loaded_from_the_file(model_dir: Path, tmp_path: Path) -> None:
    """Perturbed values (norm weights start at exactly 1.0) come back from the file, biases and q/k norms too."""
    gen = torch.Generator().manual_seed(0)
    tensors = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in checkpoint(model_dir).items()}
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(tmp_path)
    state = revert_weight_conversion(model, model.state_dict())  # as stored: each expert's tensors apart
    for name, value in tensors.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


def test_each_family_has_its_own_parameters(model_dir: Path) -> None:
    model = load_model(model_dir)
    family = model.config.model_type
    names = set(checkpoint(model_dir))
    layers = model.config.num_hidden_layers
    norms = {f"model.layers.{i}.self_attn.{n}.weight" for i in range(layers) for n in ("q_norm", "k_norm")}
    biases = {f"model.layers.{i}.self_attn.{p}.bias" for i in range(layers) for p in ("q_proj", "k_proj", "v_proj")}
    assert (norms <= names) == (family in ("qwen3", "qwen3_moe"))
    assert (biases <= names) == (family == "qwen2")
    assert model.config.num_key_value_heads == 2 and model.config.num_attention_heads == 4
    q_out = model.get_parameter("model.layers.0.self_attn.q_proj.weight").shape[0]
    # Qwen3's head size is its own (64 here), not hidden_size / num_heads (32).
    assert q_out == 4 * (64 if family in ("qwen3", "qwen3_moe") else 32)
    # The MoE's first layer is dense; the second routes to 8 experts, each stored apart.
    experts = {f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(8) for p in ("gate_proj", "up_proj")}
    assert (experts | {"model.layers.1.mlp.gate.weight"} <= names) == (family == "qwen3_moe")
    assert "model.layers.0.mlp.gate_proj.weight" in names


def test_directory_building_is_deterministic(tmp_path: Path) -> None:
    a = create_test_model_dir("qwen2", True, tmp_path / "a")
    b = create_test_model_dir("qwen2", True, tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(st.text(), st.sampled_from([*CHAT_SPECIAL_TOKENS, *THINK_TOKENS, " ", "\n", "12+34=46"])),
        max_size=6,
    ).map("".join)
)
def test_the_bpe_tokenizer_round_trips_any_text(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < len(tokenizer) for i in ids)


def test_bpe_vocabulary_specials_and_merges(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer) == 512
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == list(CHAT_SPECIAL_TOKENS)
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token) == ("<|endoftext|>", "<|im_end|>", None)
    assert tokenizer.convert_tokens_to_ids(list(THINK_TOKENS)) == [510, 511]
    # Think tags are ordinary added tokens: skipping special tokens keeps them.
    assert tokenizer.decode(tokenizer("<think>7</think>")["input_ids"], skip_special_tokens=True) == "<think>7</think>"
    # The corpus's words became merges: a word problem takes far fewer tokens than bytes.
    problem = word_problem_corpus(1, seed=5)[0]
    assert len(tokenizer(problem)["input_ids"]) < 0.5 * len(problem.encode())


def test_bpe_vocabulary_is_padded_with_reserved_specials() -> None:
    tok = train_bpe_tokenizer(["ab ab ab"], vocab_size=320)
    assert len(tok) == 320
    assert tok.convert_ids_to_tokens(319).startswith("<|reserved_")
    assert tok.decode(list(range(len(tok))), skip_special_tokens=True).endswith("</think>")
    with pytest.raises(ValueError, match="multiple of 64"):
        train_bpe_tokenizer(["ab"], vocab_size=300)


def test_the_chat_template_renders_chatml(tokenizer: PreTrainedTokenizerBase) -> None:
    conversation = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 12+34?"},
    ]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12+34?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == text.removesuffix("<|im_start|>assistant\n")
    no_think = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think == text + "<think>\n\n</think>\n\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and tokenizer.decode(ids) == text
    assert ids.count(tokenizer.eos_token_id) == 2


DEFAULT_MODEL_SHA256 = "481711389e9c308e"
"""The embedded default's initial weights (ModelSpec() with the arithmetic alphabet), as built before families."""


def test_the_default_spec_builds_the_same_model_as_before() -> None:
    model = build_model(ModelSpec(), build_tokenizer(ALPHABET))
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.contiguous().numpy().tobytes())
    assert digest.hexdigest()[:16] == DEFAULT_MODEL_SHA256
    assert model.config.model_type == "llama"


def test_model_spec_checks_head_sizes_per_family() -> None:
    # Qwen3 takes an explicit head size, even one hidden_size / num_heads is not.
    spec = ModelSpec(family="qwen3", hidden_size=96, num_heads=4, head_dim=32)
    assert spec.head_size == 32 and spec.kv_heads == 4
    with pytest.raises(ValidationError, match="qwen2 takes its head size"):
        ModelSpec(family="qwen2", hidden_size=128, num_heads=4, head_dim=64)
    with pytest.raises(ValidationError, match="head size 16"):
        ModelSpec(family="qwen3", head_dim=16)
    with pytest.raises(ValidationError, match="does not divide"):
        ModelSpec(num_heads=4, num_kv_heads=3)
    assert ModelSpec(num_kv_heads=2).kv_heads == 2


def test_model_spec_checks_the_mixture_of_experts() -> None:
    assert ModelSpec(family="qwen3_moe", num_layers=3).moe_layers == [1, 2]
    assert ModelSpec(family="qwen3", num_layers=3).moe_layers == []
    with pytest.raises(ValidationError, match="hidden_size 48 is not a multiple of 32"):
        ModelSpec(family="qwen3_moe", hidden_size=48, num_heads=1, head_dim=32)
    with pytest.raises(ValidationError, match="num_experts_per_token 9 exceeds num_experts 8"):
        ModelSpec(family="qwen3_moe", num_experts_per_token=9)
    with pytest.raises(ValidationError, match="num_dense_layers 2 leaves no MoE layer in 2 layers"):
        ModelSpec(family="qwen3_moe", num_dense_layers=2)
