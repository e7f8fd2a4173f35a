"""``asymptote up --dry-run`` and ``asymptote plan`` of an up config: the same split and the same plan.

A user with one GPU machine checks what ``up`` will run before starting it:
the size preset, the split of the GPUs between generators and learner
ranks, each rank's memory and the resolved config. Both commands take the
stack's own functions (services/local/planning.py), so they cannot
disagree; these tests say they do not, on GPUs described rather than found
(this machine has none) and on the CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from services.cli import main as cli
from services.local.config import StackConfig
from tests.helpers.badinput import BAD_INPUTS
from tests.helpers.families import QWEN3_8B, config_only

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "qwen3-gsm8k.yaml"
QWEN3_1_7B = {
    **QWEN3_8B,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "tie_word_embeddings": True,
}


@pytest.fixture
def qwen3_1_7b(tmp_path: Path) -> Path:
    return config_only(tmp_path / "qwen3-1.7b", QWEN3_1_7B)


def lines_of(text: str, *starts: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(starts)]


def test_plan_and_dry_run_print_the_same_split_and_rank_memory(
    qwen3_1_7b: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--config", str(EXAMPLE), "--model", str(qwen3_1_7b), "--gpus", "8"]
    assert cli(["plan", *args]) == 0
    planned = capsys.readouterr().out
    assert cli(["up", "--dry-run", *args]) == 0
    dry = capsys.readouterr().out
    wanted = ("placement", "learner (", "Learner rank", "│                   │ total", "│ total")
    assert len(lines_of(planned, *wanted)) == 6  # the split (two lines), the rank's header, three totals
    assert lines_of(planned, *wanted) == lines_of(dry, *wanted)
    # The stack's own split of 8 GPUs: for this config's 8 x 8 completions of 1,024 tokens, half to the
    # learner is the balanced one, a generator on each of the rest.
    placement = " ".join(lines_of(planned, "placement", "learner ("))
    assert "generator-3: GPU 3" in placement and "generator-4" not in placement
    assert "learner (4 ranks) on GPU 4,5,6,7 (split by the plan's estimate on H100 SXM" in placement
    assert "balanced split" not in planned  # the plan finds nothing better than what up runs
    assert "Learner rank: 1 of 4 (1 x 4 GPUs, FSDP2)" in planned
    # The dry run ends with the config up would run, which up takes back as it is.
    resolved = yaml.safe_load(dry.split("resolved config (asymptote up --config takes it as it is):\n", 1)[1])
    config = StackConfig.model_validate(resolved)
    assert (config.gpus, config.batch_prompts, config.max_tokens, config.lr) == (8, 8, 1024, 1e-6)


def test_the_card_s_memory_comes_from_gpu(qwen3_1_7b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--config", str(EXAMPLE), "--model", str(qwen3_1_7b), "--gpus", "8"]
    assert cli([*args, "--gpu", "l40s"]) == 0
    l40s = capsys.readouterr().out
    assert "placement (45 GiB GPUs)" in l40s and "of the 45 GiB GPU" in l40s
    assert cli([*args, "--gpu", "h200"]) == 0
    assert "placement (140.4 GiB GPUs)" in capsys.readouterr().out


def test_a_dry_run_on_the_cpu_says_where_each_process_goes_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    assert cli(["up", "--dry-run", "--gpus", "0", "--run-dir", str(run_dir), "--max-steps", "7"]) == 0
    out = capsys.readouterr().out
    assert "placement: the CPU: 1 generator(s), 1 learner rank(s) (gloo)" in out
    resolved = yaml.safe_load(out.split("takes it as it is):\n", 1)[1])
    assert resolved["max_steps"] == 7 and resolved["workload"] == "words"
    assert list(run_dir.iterdir()) == []  # nothing was started or written


def test_up_only_flags_need_an_up_config(qwen3_1_7b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with BAD_INPUTS.trying("command line", "plan --model QWEN3_1_7B --gpus 8"):
        assert cli(["plan", "--model", str(qwen3_1_7b), "--gpus", "8"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == "asymptote plan: --gpus: plans an `asymptote up` config (--config FILE of its fields) only"
    with BAD_INPUTS.trying("command line", "plan --config examples/qwen3-gsm8k.yaml --model QWEN3_1_7B"):
        assert cli(["plan", "--config", str(EXAMPLE), "--model", str(qwen3_1_7b)]) == 2
        assert "--gpus: needed to plan an `asymptote up` config" in capsys.readouterr().err


def plan_step_seconds(out: str) -> tuple[float, float]:
    """(generating, training) seconds a step, from the plan's time table."""
    found = dict(re.findall(r"│ (generating|training) .*?([\d.,]+) s a step", out))
    return float(found["generating"].replace(",", "")), float(found["training"].replace(",", ""))


def test_the_default_split_follows_the_plan_s_balance_and_says_so(
    qwen3_1_7b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-1.7B's size preset (48 x 16 completions of 8,192 tokens) on 8 H100s: half and half is
    generation-bound by the plan's own estimate, so up's default gives the generators six GPUs and says
    why; the step it plans is shorter than half and half's, which the same command plans when asked."""
    args = ["up", "--dry-run", "--model", str(qwen3_1_7b), "--gpus", "8", "--run-dir", str(tmp_path / "run")]
    assert cli(args) == 0
    balanced = capsys.readouterr().out
    flat = " ".join(balanced.split())  # the table wraps its lines at spaces
    assert "generator-5: GPU 5; learner (2 ranks) on GPU 6,7 (split by the plan's estimate on H100 SXM:" in flat
    assert "generator-6" not in flat and "num_generators or learner_gpus sets it)" in flat
    assert cli([*args, "--learner-gpus", "4"]) == 0
    half = capsys.readouterr().out
    assert "learner (4 ranks) on GPU 4,5,6,7" in " ".join(half.split()) and "split by the plan" not in half
    gen_b, train_b = plan_step_seconds(balanced)
    gen_h, train_h = plan_step_seconds(half)
    assert gen_h > train_h  # half and half waits on generation
    assert max(gen_b, train_b) < max(gen_h, train_h) / 1.3  # about 1.5x shorter a step
    # The balanced split is the best of every split of 8 whose learner fits (1 to 7 generators).
    steps = []
    for learner_gpus in range(1, 8):
        code = cli([*args, "--learner-gpus", str(learner_gpus)])
        out = capsys.readouterr()
        if code == 0:
            steps.append(max(plan_step_seconds(out.out)))
    assert steps and max(gen_b, train_b) == pytest.approx(min(steps), rel=0.01)
