"""``asymptote export``: a learner checkpoint becomes a model directory transformers loads as the learner scores.

A Qwen3 test model (BPE tokenizer, ChatML template) takes two learner steps
and is checkpointed (the sharded DCP format); the export is loaded with
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer`` alone, and
its log-probs of the batch's completions equal the learner's within 1e-5
(float32 stored, float32 served). A bf16-stored model is exported in bf16,
each tensor the learner's float32 master rounded once. Bad requests get one
line and exit 2. vLLM serving an export: tests/generator/test_architectures.py
(its bf16 engine starts from one).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.cli import main as cli
from services.embedded.build import cast_model_dir, create_test_model_dir
from services.learner import checkpoint
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.export import export, keep_model_files
from services.learner.model import completion_logprobs, load_model, load_tokenizer
from services.learner.trainer import Trainer, collate
from tests.learner.ddp_worker import batch

PARITY = 1e-5


def trained_run(model_dir: Path, run_dir: Path, steps: int = 2) -> tuple[Trainer, list[object]]:
    """A learner that took ``steps`` steps on ``model_dir`` and checkpointed into ``run_dir`` as the service does."""
    keep_model_files(model_dir, run_dir)
    trainer = Trainer(load_model(model_dir), LossSettings(), OptimizerSettings(lr=1e-2, warmup_steps=0))
    trainer.checkpointer = checkpoint.Checkpointer(run_dir / "checkpoints", keep=2, distributed=False, rank=0)
    rng = random.Random(3)
    batches = [batch(rng, s, 3) for s in range(steps)]
    for s, groups in enumerate(batches):
        trainer.step(collate(groups, pad_id=0), learner_version=s)
        trainer.save(s + 1, trainer.meta(s + 1, s + 1))
        trainer.checkpointer.finish()
    return trainer, batches


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_test_model_dir("qwen3", False, tmp_path_factory.mktemp("export") / "qwen3")


def test_an_export_scores_as_the_learner_does(qwen3: Path, tmp_path: Path) -> None:
    trainer, batches = trained_run(qwen3, tmp_path / "run")
    out = export(tmp_path / "run", tmp_path / "exported", shard_bytes=200_000)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert len(set(modes.values())) == 1, modes  # the shards as readable as the config beside them
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files and "config.json" in files and "tokenizer.json" in files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded: the index path is exercised
    assert set(index["weight_map"]) == set(load_model(qwen3).state_dict())  # the model's names, no more
    provenance = json.loads((out / "asymptote-export.json").read_text())
    assert (provenance["step"], provenance["checkpoint"]) == (2, "ckpt-00000002")

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    original = load_tokenizer(qwen3)
    chat = [{"role": "user", "content": "What is 12 + 34?"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(chat, tokenize=False)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager")
    inputs = collate(batches[-1], pad_id=0)  # type: ignore[arg-type]
    with torch.no_grad():
        learner = completion_logprobs(trainer.model, inputs.batch)
        exported = completion_logprobs(model, inputs.batch)
    gap = float((learner - exported).abs().max())
    print(f"export vs learner: largest log-prob difference {gap:.2e}")
    assert gap <= PARITY
    # The step before is still there, and differs.
    earlier = export(tmp_path / "run", tmp_path / "step1", step=1)
    with torch.no_grad():
        before = completion_logprobs(AutoModelForCausalLM.from_pretrained(str(earlier)), inputs.batch)
    assert float((before - learner).abs().max()) > 1e-3


def test_a_bf16_model_is_exported_in_bf16(tmp_path: Path) -> None:
    model_dir = cast_model_dir(create_test_model_dir("llama", True, tmp_path / "llama"), torch.bfloat16)
    trainer, _ = trained_run(model_dir, tmp_path / "run", steps=1)
    out = export(tmp_path / "run", tmp_path / "exported")
    master = trainer.model.state_dict()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == {n for n in master if n != "lm_head.weight"}  # a tied head stored once, as given
        for name in names:
            stored = f.get_tensor(name)
            assert stored.dtype == torch.bfloat16, name
            assert torch.equal(stored, master[name].to(torch.bfloat16)), name


def test_bad_export_requests_get_one_line(qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trained_run(qwen3, tmp_path / "run", steps=1)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy2(qwen3 / "config.json", no_weights / "config.json")
    # Another model: the same names, wider layers; another family: other names too.
    wider = create_test_model_dir("qwen3", False, tmp_path / "wider", intermediate_size=96)
    llama = create_test_model_dir("llama", True, tmp_path / "llama")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("taken")
    capsys.readouterr()  # what building the models printed
    cases = {
        ("export", str(tmp_path / "run"), "--to", str(tmp_path / "full")): "exists and is not an empty directory",
        ("export", str(tmp_path / "run"), "--to", str(tmp_path / "o"), "--step", "7"): "hold steps [1]",
        ("export", str(tmp_path / "nowhere"), "--to", str(tmp_path / "o")): "not a directory",
        ("export", str(tmp_path), "--to", str(tmp_path / "o"), "--model", str(qwen3)): "no committed checkpoint",
        ("export", str(tmp_path / "run"), "--to", "/proc/forbidden/o"): "--to /proc/forbidden/o: cannot write there",
        ("export", str(tmp_path / "run"), "--to", str(tmp_path / "o"), "--model", str(no_weights)): (
            "its weights cannot be read"
        ),
        ("export", str(tmp_path / "run"), "--to", str(tmp_path / "o"), "--model", str(wider)): (
            "differ in shape from checkpoint"
        ),
        ("export", str(tmp_path / "run"), "--to", str(tmp_path / "o"), "--model", str(llama)): (
            "not the model this run trained"
        ),
    }
    for argv, said in cases.items():
        assert cli(list(argv)) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err, err
    assert not (tmp_path / "o").exists()
