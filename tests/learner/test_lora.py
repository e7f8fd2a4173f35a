"""A LoRA on the learner: peft's numbers, only the adapter trains, checkpoints hold the adapter and resume it
exactly, and export writes what peft loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, PreTrainedModel

from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import ConfigError, ModelError
from asymptote.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSettings
from services.learner import adapter, checkpoint
from services.learner.checkpoint import Checkpointer
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.model import PackedBatch, completion_logprobs, empty_model, pack
from services.learner.trainer import Trainer, collate
from tests.helpers.families import build

LORA = LoraSettings(rank=4, alpha=8)
OPT = OptimizerSettings(lr=1e-2, warmup_steps=0, weight_decay=0.01)
PROMPTS = [[1, 5, 6, 9], [1, 7], [2, 3, 4]]
COMPLETIONS = [[7, 8, 2], [9, 10, 11, 12], [4]]


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 (untied head, q/k norms) and Qwen2 (tied head, attention biases)."""
    return build(request.param, tmp_path_factory.mktemp(request.param))


def lora_trainer(model_dir: Path, lora: LoraSettings = LORA, resume: Path | None = None) -> Trainer:
    trainer = Trainer(empty_model(model_dir), LossSettings(), OPT, lora=lora, packing=False)
    trainer.start(model_dir, resume)
    return trainer


def randomize_b(model: torch.nn.Module, seed: int = 0) -> None:
    """B starts at zero (the policy starts as the base): give it values, so the adapter changes the numbers."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {file: state[key].detach().clone() for file, key in adapter.file_names(model).items()}


def peft_logprobs(model: PreTrainedModel, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
    """A plain forward of each unpadded sequence through ``model``: [N, T] log-probs, 0 past each completion."""
    out = torch.zeros(len(prompts), max(len(c) for c in completions))
    with torch.no_grad():
        for n, (p, c) in enumerate(zip(prompts, completions)):
            logits = model(input_ids=torch.tensor([p + c])).logits[0].double()
            logp = torch.log_softmax(logits[len(p) - 1 : -1], dim=-1)
            out[n, : len(c)] = logp.gather(1, torch.tensor(c)[:, None]).squeeze(1).float()
    return out


def plain_peft(model_dir: Path, tensors: dict[str, torch.Tensor]) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = get_peft_model(base, adapter.peft_config(LORA))
    result = set_peft_model_state_dict(peft_model, tensors)
    assert not result.unexpected_keys
    return peft_model.eval()


def batch() -> PackedBatch:
    return pack(PROMPTS, COMPLETIONS, pad_id=0)


def test_log_probs_with_the_adapter_equal_a_plain_peft_models(model_dir: Path) -> None:
    trainer = lora_trainer(model_dir)
    randomize_b(trainer.model)
    with torch.no_grad():
        logp = completion_logprobs(trainer.model, batch())
    reference = plain_peft(model_dir, adapter_tensors(trainer.model))
    torch.testing.assert_close(logp, peft_logprobs(reference, PROMPTS, COMPLETIONS), rtol=0, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert (logp - peft_logprobs(base, PROMPTS, COMPLETIONS)).abs().max() > 1e-2  # the adapter counts


def groups() -> list[rollout_pb2.RolloutGroup]:
    out = []
    for i, (prompt, rewards) in enumerate(zip(PROMPTS[:2], ([1.0, 0.0], [0.0, 1.0]))):
        completions = [
            rollout_pb2.Completion(
                token_ids=c, logprobs=[-1.0] * len(c), version_spans=[rollout_pb2.VersionSpan(start=0, end=len(c))]
            )
            for c in COMPLETIONS[:2]
        ]
        for c, r in zip(completions, rewards):
            c.reward = r
        task = rollout_pb2.GenerationTask(task_id=f"g{i}", sampling=rollout_pb2.SamplingParams(temperature=1.0))
        out.append(
            rollout_pb2.RolloutGroup(group_id=f"g{i}", task=task, prompt_token_ids=prompt, completions=completions)
        )
    return out


def test_a_step_changes_the_adapter_only(model_dir: Path) -> None:
    trainer = lora_trainer(model_dir)
    randomize_b(trainer.model)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.step(collate(groups(), 0), learner_version=1)
    assert metrics["optim/grad_norm"] > 0
    after = dict(trainer.model.named_parameters())
    adapted = {n for n in before if adapter.is_adapter(n)}
    assert adapted and all(".lora_A." in n or ".lora_B." in n for n in adapted)
    for name, param in after.items():
        if name in adapted:
            assert not torch.equal(param, before[name]), name
        else:
            assert torch.equal(param, before[name]), name  # bit-identical
            assert param.grad is None and not param.requires_grad, name
    held = {id(p) for p in trainer.optimizer.state}
    assert held == {id(after[n]) for n in adapted}  # AdamW state for the adapter only
    # The frozen base computes in the body's dtype; the root (embeddings, norm, head) keeps float32.
    assert trainer.model.get_output_embeddings().weight.dtype == torch.float32
    assert set(trainer.state_dict()["model"]) == adapted


def test_a_checkpoint_holds_the_adapter_and_resumes_exactly(model_dir: Path, tmp_path: Path) -> None:
    trainer = lora_trainer(model_dir)
    trainer.checkpointer = Checkpointer(tmp_path, keep=2, distributed=False, rank=0)
    trainer.step(collate(groups(), 0), learner_version=1)
    trainer.save(1, trainer.meta(version=1, step=1))
    path = trainer.checkpointer.finish()
    assert path is not None
    stored = checkpoint.weight_names(path)
    assert stored and all(adapter.is_adapter(n) for n in stored)  # no base tensor in the checkpoint
    restored = checkpoint.read(path)
    assert restored.lora == LORA.model_dump(mode="json")
    assert restored.base == {"model_dir": str(model_dir.resolve()), "digest": adapter.base_digest(model_dir)}

    resumed = lora_trainer(model_dir, resume=path)
    for (n1, p1), (n2, p2) in zip(trainer.model.named_parameters(), resumed.model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    saved, loaded = trainer.full_state().optimizer, resumed.full_state().optimizer
    assert saved["state"].keys() == loaded["state"].keys()
    for key, moments in saved["state"].items():
        for k, v in moments.items():
            assert torch.equal(v, loaded["state"][key][k]), (key, k)
    # The next step is the same step on both.
    trainer.step(collate(groups(), 0), learner_version=2)
    resumed.step(collate(groups(), 0), learner_version=2)
    for (n1, p1), (_, p2) in zip(trainer.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p1, p2), n1


def test_a_checkpoint_of_another_kind_is_refused_by_name(model_dir: Path, tmp_path: Path) -> None:
    trainer = lora_trainer(model_dir)
    trainer.checkpointer = Checkpointer(tmp_path, keep=2, distributed=False, rank=0)
    trainer.save(1, trainer.meta(version=1, step=0))
    path = trainer.checkpointer.finish()
    assert path is not None
    with pytest.raises(ModelError, match=r"lora: checkpoint .* trained .*'rank': 4.*the config says .*'rank': 8"):
        lora_trainer(model_dir, LoraSettings(rank=8, alpha=8), resume=path)
    with pytest.raises(ModelError, match="holds a LoRA adapter; this learner trains every weight"):
        Trainer(empty_model(model_dir), LossSettings(), OPT, packing=False).start(model_dir, path)


def test_a_target_module_the_model_lacks_is_refused_in_one_line(model_dir: Path) -> None:
    lora = LoraSettings(rank=4, target_modules=("q_proj", "w_qkv"))
    with pytest.raises(ConfigError) as caught:
        Trainer(empty_model(model_dir), LossSettings(), OPT, lora=lora)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("lora.target_modules: ") and "no linear layer named w_qkv" in message
    assert "q_proj" in message and "down_proj" in message  # what it has


@pytest.mark.parametrize("rank", [0, -3])
def test_a_rank_below_one_is_refused(rank: int) -> None:
    with pytest.raises(ValueError, match="rank\n  Input should be greater than or equal to 1"):
        LoraSettings(rank=rank)


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 stored in bf16, as real checkpoints are: the dtype a merged export is cast back to."""
    source = build("qwen3", tmp_path_factory.mktemp("qwen3-f32"))
    out = tmp_path_factory.mktemp("qwen3-bf16")
    AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.bfloat16).save_pretrained(str(out))
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def trained_run(model_dir: Path, run_dir: Path) -> Trainer:
    """A run directory with a LoRA checkpoint whose adapter is far from zero."""
    from services.learner.export import keep_model_files

    keep_model_files(model_dir, run_dir)
    trainer = lora_trainer(model_dir)
    randomize_b(trainer.model, seed=1)
    trainer.checkpointer = Checkpointer(run_dir / "checkpoints", keep=2, distributed=False, rank=0)
    trainer.step(collate(groups(), 0), learner_version=1)
    trainer.save(1, trainer.meta(version=1, step=1))
    trainer.checkpointer.finish()
    return trainer


def test_the_exported_adapter_loads_in_peft_with_the_learners_log_probs(bf16_model_dir: Path, tmp_path: Path) -> None:
    from services.learner.export import export

    trainer = trained_run(bf16_model_dir, tmp_path / "run")
    out = export(tmp_path / "run", tmp_path / "adapter")
    assert {p.name for p in out.iterdir()} >= {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    config = adapter.read_config(out)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert config["base_model_name_or_path"] == str(bf16_model_dir.resolve())
    assert sorted(config["target_modules"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    base = AutoModelForCausalLM.from_pretrained(str(bf16_model_dir), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        learner = completion_logprobs(trainer.model, batch())
    torch.testing.assert_close(peft_logprobs(loaded, PROMPTS, COMPLETIONS), learner, rtol=0, atol=1e-5)


def test_a_merged_export_is_the_base_plus_the_update_rounded_once(bf16_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from services.learner.export import export

    trainer = trained_run(bf16_model_dir, tmp_path / "run")
    out = export(tmp_path / "run", tmp_path / "merged", merge=True)
    merged = load_file(str(out / "model.safetensors"))
    base = load_file(str(bf16_model_dir / "model.safetensors"))
    assert merged.keys() == base.keys() and all(t.dtype == torch.bfloat16 for t in merged.values())
    state = trainer.model.state_dict()
    name = "model.layers.0.mlp.down_proj"
    a, b = state[f"{name}.lora_A.default.weight"], state[f"{name}.lora_B.default.weight"]
    # Merged in float32, rounded to bf16 once.
    expected = (base[f"{name}.weight"].float() + LORA.scaling * (b @ a)).to(torch.bfloat16)
    assert torch.equal(merged[f"{name}.weight"], expected)
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        learner = completion_logprobs(trainer.model, batch())
    gap = (peft_logprobs(model, PROMPTS, COMPLETIONS) - learner).abs().max()
    print(f"merged bf16 export vs the adapter's log-probs: max {gap:.2e} nats")
    assert gap < 5e-3  # the bf16 rounding of the merged weights, once (measured 6.7e-4)


def test_merge_refuses_a_base_of_another_digest(bf16_model_dir: Path, tmp_path: Path) -> None:
    from services.learner.export import export

    trained_run(bf16_model_dir, tmp_path / "run")
    other = build("qwen3", tmp_path / "other")  # the same shapes, other weights
    with pytest.raises(ConfigError, match=r"--merge: --model .* is not the base checkpoint ckpt-\d+ trained over"):
        export(tmp_path / "run", tmp_path / "merged", model_dir=other, merge=True)


def test_the_planner_fits_qwen3_8b_with_a_rank_32_lora_on_one_80_gb_gpu(tmp_path: Path) -> None:
    from services.learner.activations import ModelShape
    from services.learner.config import LearnerConfig
    from services.learner.memory import GIB, adapter_parameters, plan_host, plan_learner
    from tests.helpers.families import QWEN3_8B, config_only

    shape = ModelShape.read(config_only(tmp_path / "qwen3-8b", QWEN3_8B))
    lora = LoraSettings(rank=32)
    # Qwen3-8B: 36 layers x 32 x (q 8192 + k 5120 + v 5120 + o 8192 + gate 16384 + up 16384 + down 16384).
    assert adapter_parameters(shape, lora) == 36 * 32 * 75_776 == 87_293_952
    settings = {"model_dir": tmp_path, "micro_batch_tokens": 32_768, "activation_checkpointing": True}
    full = LearnerConfig.model_validate(settings)
    adapted = LearnerConfig.model_validate({**settings, "lora": lora})
    plans = {
        name: plan_learner(shape, config, gpus_per_node=1, gpu_memory_gib=80.0, sequence_tokens=8_704)
        for name, config in (("full", full), ("lora", adapted))
    }
    held = {i.name: i.num_bytes for i in plans["lora"].held}
    # The base in bf16 (decoder layers) and float32 (embeddings, final norm, untied head); 16 bytes an adapter
    # parameter: float32 weight, gradient and two AdamW moments.
    layers = shape.num_layers * shape.layer_parameters * 2
    root = shape.root_parameters * 4
    assert held["frozen base"] == layers + root
    assert held["adapter weights"] + held["gradients"] + held["AdamW moments"] == 16 * 87_293_952
    assert not plans["full"].fits and plans["lora"].fits
    lora_gib = plans["lora"].total_bytes / GIB
    print(
        f"Qwen3-8B r32 on 80 GiB: {lora_gib:.2f} GiB ({plans['lora'].fraction:.0%}), full: "
        f"{plans['full'].total_bytes / GIB:.2f} GiB"
    )
    assert lora_gib == pytest.approx(50.56, abs=0.01)
    assert plans["lora"].usable_bytes - plans["lora"].total_bytes > 20 * GIB  # 21.4 GiB to spare under 90%
    host = plan_host(shape, adapted, gpus_per_node=1)
    assert host.checkpoint_bytes < 2 * GIB  # the adapter and its moments only: 12 bytes x 87M + metadata


def test_plan_takes_a_lora_rank_and_says_by_how_much_it_fits(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.helpers.families import QWEN3_8B, config_only

    model = config_only(tmp_path / "qwen3-8b", QWEN3_8B)
    argv = [sys.executable, "-m", "services.cli", "plan", "--model", str(model), "--gpus-per-node", "1"]
    proc = subprocess.run([*argv, "--gpu-memory", "80", "--lora-rank", "32"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "LoRA rank 32: 87.3M adapter parameters" in proc.stdout
    assert "fits with 21.4 GiB to spare" in proc.stdout
    bad = subprocess.run([*argv, "--lora-rank", "0"], capture_output=True, text=True)
    assert (bad.returncode, bad.stderr.strip().splitlines()) == (
        2,
        ["asymptote plan: --lora-rank 0: must be at least 1"],
    )
