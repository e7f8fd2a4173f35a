"""The tiny local model: tokenizer, model directory, inference helpers, warm start and its cache."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from asymptote.tasks import ALPHABET, ArithmeticSettings, ArithmeticTask, get_task
from services.embedded import onpolicy, warmstart
from services.embedded.build import ModelSpec, build_model, build_tokenizer, create_model_dir
from services.embedded.onpolicy import OnPolicySettings, run_onpolicy
from services.embedded.warmstart import WarmstartSettings, prepare_model, supervised_pass
from services.learner.model import (
    completion_logprobs,
    count_parameters,
    load_model,
    load_tokenizer,
    pack,
    sample,
)

TINY = ModelSpec(hidden_size=32, num_heads=1, num_layers=1, intermediate_size=64, max_position_embeddings=32)
TINY_TASK = ArithmeticSettings(max_digits=2, num_train=400, num_heldout=16)


def test_tokenizer_vocabulary_and_exact_round_trip() -> None:
    tok = build_tokenizer(ALPHABET)
    assert len(tok) == 32
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 4, 13, 14, 15, 16, 17]) == [
        "<pad>",
        "<bos>",
        "<eos>",
        "<unk>",
        "0",
        "9",
        "+",
        "-",
        "=",
        "<reserved_0>",
    ]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok("37+485=")["input_ids"] == [1, 7, 11, 14, 8, 12, 9, 16]
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 20)))
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text) + 1
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode([*ids[1:], tok.eos_token_id], skip_special_tokens=True) == text
    # Every id the model can sample decodes; reserved and special ids vanish.
    assert tok.decode(list(range(32)), skip_special_tokens=True) == ALPHABET


def test_tokenizer_rejects_bad_alphabets() -> None:
    with pytest.raises(ValueError, match="alphabet"):
        build_tokenizer("")
    with pytest.raises(ValueError, match="alphabet"):
        build_tokenizer("0 1")


def test_model_spec_rejects_head_sizes_vllm_cpu_lacks() -> None:
    with pytest.raises(ValidationError, match="head size 16"):
        ModelSpec(hidden_size=64, num_heads=4)
    with pytest.raises(ValidationError, match="not divisible"):
        ModelSpec(hidden_size=100, num_heads=3)


def test_model_directory_layout_and_reload(tmp_path: Path) -> None:
    out = create_model_dir(TINY, ALPHABET, tmp_path / "m")
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["hidden_size"], config["head_dim"]) == (
        "llama",
        32,
        32,
        32,
    )
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = load_tokenizer(out)
    model = load_model(out)
    assert tok("037+485=")["input_ids"] == build_tokenizer(ALPHABET)("037+485=")["input_ids"]
    assert tok.padding_side == "left"
    fresh = build_model(TINY, build_tokenizer(ALPHABET))
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    torch.testing.assert_close(model(ids).logits, fresh(ids).logits)


def test_forward_shapes_dtype_and_parameter_count() -> None:
    model = build_model(TINY, build_tokenizer(ALPHABET))
    h, i, v = 32, 64, 32
    # Tied embedding + per layer (q,k,v,o + gate,up,down + 2 norms) + final norm.
    assert count_parameters(model) == v * h + (4 * h * h + 3 * h * i + 2 * h) + h
    logits = model(torch.zeros((3, 7), dtype=torch.long)).logits
    assert logits.shape == (3, 7, 32)
    assert logits.dtype == torch.float32


def test_packed_logprobs_equal_unpadded_forward() -> None:
    tok = build_tokenizer(ALPHABET)
    model = build_model(TINY, tok)
    prompts = [tok(p)["input_ids"] for p in ("1+2=", "123+45=", "9=")]
    completions = [[7, 2], [5, 6, 7, 2], [2]]
    batch = pack(prompts, completions, tok.pad_token_id)
    assert batch.input_ids.shape == (3, 8 + 4)
    assert batch.completion_mask.sum(dim=1).tolist() == [2, 4, 1]
    with torch.no_grad():
        got = completion_logprobs(model, batch)
        for n, (p, c) in enumerate(zip(prompts, completions)):
            full = model(torch.tensor([p + c])).logits[0].log_softmax(-1)
            want = full[len(p) - 1 : -1].gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
            torch.testing.assert_close(got[n, : len(c)], want, atol=1e-5, rtol=0)
            assert got[n, len(c) :].abs().sum() == 0


def test_sampler_logprobs_match_training_forward() -> None:
    tok = build_tokenizer(ALPHABET)
    model = build_model(TINY, tok)
    prompts = [tok(p)["input_ids"] for p in ("1+2=", "123+45=", "9=", "77+7=")] * 4
    out = sample(model, prompts, 6, tok.eos_token_id, tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    for c, lp, cut in zip(out.completions, out.logprobs, out.truncated):
        assert len(c) == len(lp) and 1 <= len(c) <= 6
        assert cut == (c[-1] != tok.eos_token_id)
        assert tok.eos_token_id not in c[:-1]
    with torch.no_grad():
        want = completion_logprobs(model, pack(prompts, out.completions, tok.pad_token_id))
    for n, lp in enumerate(out.logprobs):
        torch.testing.assert_close(want[n, : len(lp)], torch.tensor(lp), atol=1e-5, rtol=0)


def test_tiny_warm_start_lowers_the_loss() -> None:
    task = get_task("arithmetic", TINY_TASK)
    tok = build_tokenizer(ALPHABET)
    model = build_model(TINY, tok)
    settings = WarmstartSettings(
        max_steps=60, batch_size=32, lr=3e-3, warmup_steps=5, target_pass_rate=1.0, check_every_steps=1000
    )
    report = supervised_pass(model, tok, task, settings, log_every=0)
    assert report.num_steps == 60 and not report.reached_target
    # Uniform over 32 tokens is ln 32 = 3.47 nats; learning the answer format
    # (digits, then EOS) takes it to about 1.7 in 60 steps (measured 3.46 -> 1.72).
    assert report.losses[0] > 3.2
    assert sum(report.losses[-10:]) / 10 < report.losses[0] - 1.0


def test_warm_start_stops_at_the_target_pass_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    task = get_task("arithmetic", TINY_TASK)
    tok = build_tokenizer(ALPHABET)
    rates = iter([0.05, 0.2, 0.5])
    monkeypatch.setattr(
        warmstart,
        "sampled_pass_rate",
        lambda *a, **k: warmstart.EvalResult(pass_rate=next(rates), num_prompts=1, num_samples=2, truncation_rate=0.0),
    )
    settings = WarmstartSettings(max_steps=100, batch_size=8, target_pass_rate=0.3, check_every_steps=2)
    report = supervised_pass(build_model(TINY, tok), tok, task, settings, log_every=0)
    assert (report.num_steps, report.probe_pass_rate, report.reached_target) == (6, 0.5, True)


def test_prepare_model_caches_by_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = WarmstartSettings(
        max_steps=3, batch_size=8, target_pass_rate=1.0, check_every_steps=1000, eval_samples_per_prompt=1
    )
    first = prepare_model(tmp_path, TINY, TINY_TASK, settings)
    assert first.parent == tmp_path and first.name.startswith("warmstart-")
    meta = json.loads((first / "warmstart.json").read_text())
    assert meta["num_steps"] == 3 and meta["num_parameters"] == 11_360
    assert 0.0 <= meta["heldout_pass_rate"] <= 1.0
    assert load_model(first).config.vocab_size == 32

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cache hit must not train again")

    monkeypatch.setattr(warmstart, "supervised_pass", no_rebuild)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert prepare_model(tmp_path, TINY, TINY_TASK, settings) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    # Any changed setting is another key; nothing half-written is left behind.
    with pytest.raises(AssertionError, match="must not train"):
        prepare_model(tmp_path, TINY, TINY_TASK, settings.model_copy(update={"seed": 1}))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != warmstart.LOCKS_DIR) == [first.name]


class _ParityRewardTask(ArithmeticTask):
    """Rewards completions of even length: groups of an untrained model then
    have reward variance, so every step takes a gradient step."""

    def score(self, completion_text: str, reference: str) -> float:
        return float(len(completion_text) % 2 == 0)


@pytest.mark.parametrize("lag_steps", [0, 2])
def test_onpolicy_loop_records_and_is_ratio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lag_steps: int) -> None:
    settings = WarmstartSettings(max_steps=5, batch_size=8, target_pass_rate=1.0, check_every_steps=1000)
    model_dir = prepare_model(tmp_path, TINY, TINY_TASK, settings)
    monkeypatch.setattr(onpolicy, "get_task", lambda name, s: _ParityRewardTask(s))
    records = run_onpolicy(
        model_dir,
        OnPolicySettings(
            task=TINY_TASK,
            num_steps=4,
            num_prompts_per_step=4,
            group_size=8,
            eval_every_steps=2,
            eval_samples_per_prompt=1,
            lag_steps=lag_steps,
            lr=1e-2,
            warmup_steps=0,
        ),
    )
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in records if "eval/pass_rate" in r] == [0, 2, 4]
    assert all(r["time/gen_s"] > 0 and r["time/update_s"] > 0 for r in records[1:])
    updates = [r for r in records[1:] if "loss/value" in r]
    assert len(updates) == 4 - lag_steps
    for r in updates:
        assert r["batch/kept_prompts"] >= 1
        if lag_steps == 0:
            # Same weights sampled and scored: the KV-cached sampler and the
            # training forward agree, so rho = 1 and nothing is capped.
            assert r["is/mean_abs_log_ratio"] < 1e-5
            assert r["is/rho_max"] == pytest.approx(1.0, abs=1e-4)
    if lag_steps:
        # Rollouts two updates old at lr 1e-2: the learner has moved away.
        assert updates[-1]["is/mean_abs_log_ratio"] > 1e-3


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ("drop", "1 model weights the checkpoint lacks: model.norm.weight"),
        ("extra", "1 checkpoint weights the model does not take: model.layers.0.self_attn.q_norm.weight"),
        ("reshape", "weights whose shapes differ: model.layers.0.mlp.up_proj.weight"),
    ],
)
def test_a_checkpoint_that_does_not_fit_the_model_is_refused_by_name(tmp_path: Path, edit: str, named: str) -> None:
    """A weight either side lacks is an error that names it, never a silent skip
    (a Qwen3 checkpoint read as a Llama once dropped its q_norm/k_norm)."""
    from safetensors.torch import load_file, save_file

    from asymptote.errors import ModelError

    out = create_model_dir(TINY, ALPHABET, tmp_path / "m")
    tensors = load_file(str(out / "model.safetensors"))
    if edit == "drop":
        del tensors["model.norm.weight"]
    elif edit == "extra":
        tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(TINY.hidden_size // TINY.num_heads)
    else:
        tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(TINY.intermediate_size + 1, TINY.hidden_size)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match="does not fit LlamaForCausalLM") as caught:
        load_model(out)
    assert named in str(caught.value)
