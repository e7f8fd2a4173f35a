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

from asymptote.contracts.v1 import rollout_pb2
from services.cli import main as cli
from services.embedded.build import cast_model_dir, create_test_model_dir
from services.learner import checkpoint
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.export import export, keep_model_files
from services.learner.model import completion_logprobs, load_model, load_tokenizer
from services.learner.trainer import Trainer, collate
from tests.helpers.badinput import BAD_INPUTS
from tests.learner.ddp_worker import batch

PARITY = 1e-5


def trained_run(
    model_dir: Path, run_dir: Path, steps: int = 2, keep: int = 2, best: rollout_pb2.BestRound | None = None
) -> tuple[Trainer, list[object]]:
    """A learner that took ``steps`` steps on ``model_dir`` and checkpointed into ``run_dir`` as the service does,
    keeping ``keep`` checkpoints and ``best``'s."""
    keep_model_files(model_dir, run_dir)
    trainer = Trainer(load_model(model_dir), LossSettings(), OptimizerSettings(lr=1e-2, warmup_steps=0))
    trainer.checkpointer = checkpoint.Checkpointer(
        run_dir / "checkpoints", keep=keep, distributed=False, rank=0, keep_best=best is not None
    )
    if best is not None:
        trainer.checkpointer.set_best(best)
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
    assert_one_line_refusals(cases, capsys)
    assert not (tmp_path / "o").exists()


def assert_one_line_refusals(cases: dict[tuple[str, ...], str], capsys: pytest.CaptureFixture[str]) -> None:
    """Each command line exits 2 with one line on stderr saying what it maps to; recorded in the bad-input report
    (with what it must say: one command line over a run in several states is several inputs)."""
    for argv, said in cases.items():
        with BAD_INPUTS.trying("command line", f"{' '.join(argv)} ({said})"):
            try:
                code = cli(list(argv))
            except SystemExit as exit:  # argparse's own refusals
                code = exit.code
            assert code == 2, argv
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and said in err and "Traceback" not in err, err


def write_evals(run_dir: Path, rates: dict[int, float]) -> None:
    rows = [{"step": v, "policy_version": v, "compute": float(v), "pass_rate": r} for v, r in rates.items()]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_export_best_writes_the_best_round_s_checkpoint(
    qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    # Three steps, one checkpoint kept beside the best round's (version 1's).
    trained_run(qwen3, run, steps=3, keep=1, best=rollout_pb2.BestRound(policy_version=1, pass_rate=0.5, num_rounds=2))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-00000001", "ckpt-00000003"]
    write_evals(run, {0: 0.2, 1: 0.5, 2: 0.3, 3: 0.4})
    capsys.readouterr()
    assert cli(["export", str(run), "--to", str(tmp_path / "best"), "--best"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line == (
        f"exported version 1 (held-out pass rate 0.500, the best of 4 eval rounds) to {(tmp_path / 'best').resolve()}"
    )
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "best"), dtype=torch.float32)
    loaded = model.state_dict()
    kept = checkpoint.read_weights(run / "checkpoints" / "ckpt-00000001")
    for name, tensor in kept.items():
        assert torch.equal(loaded[name], tensor), name
    newest = checkpoint.read_weights(run / "checkpoints" / "ckpt-00000003")
    assert any(not torch.equal(newest[n], kept[n]) for n in kept)  # the newest is other weights
    # The best round at version 2, whose stand-in the learner marked: the newest checkpoint before it.
    write_evals(run, {0: 0.2, 1: 0.5, 2: 0.6, 3: 0.4})
    (run / "checkpoints" / "ckpt-00000001" / checkpoint.BEST).write_text(
        json.dumps({"policy_version": 2, "pass_rate": 0.6, "num_rounds": 4})
    )
    assert cli(["export", str(run), "--to", str(tmp_path / "stand-in"), "--best"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(
        "exported version 1, the newest checkpoint before the best round's version 2 (held-out pass rate 0.600, "
    )


def test_export_best_without_the_best_round_s_checkpoint_says_why(
    qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    trained_run(qwen3, run, steps=3, keep=1)
    capsys.readouterr()
    to = str(tmp_path / "o")
    cases: dict[tuple[str, ...], str] = {
        ("export", str(run), "--to", to, "--best"): "eval.jsonl holds no eval round",
        ("export", str(run), "--to", to, "--best", "--step", "3"): "not allowed with argument",
    }
    assert_one_line_refusals(cases, capsys)
    write_evals(run, {0: 0.6, 3: 0.4})
    assert_one_line_refusals(
        {("export", str(run), "--to", to, "--best"): "version 0 is the model the run started from"}, capsys
    )
    write_evals(run, {0: 0.2, 2: 0.6, 3: 0.4})
    assert_one_line_refusals(
        {
            ("export", str(run), "--to", to, "--best"): (
                "--best: the best held-out round, version 2 (pass rate 0.600), has no checkpoint: it left the newest "
            )
        },
        capsys,
    )
    assert not (tmp_path / "o").exists()
