"""A two-rank gloo learner equals a one-rank learner (torchrun, the real Trainer).

Both runs take the same steps on the same batches (edge cases included: a
zero-variance prompt, one-token completions, masked tokens, rewards in
{0, 1} and {-1, +1}, a step with fewer prompts than ranks) for four loss
configurations; the parameters must agree to 1e-5 and so must the step
metrics that depend on every rank's scores.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ddp_worker.py")
sys.path.insert(0, str(WORKER.parent))
from ddp_worker import CONFIGS, tiny_model  # noqa: E402

PARITY = 1e-5
SCORED = [
    "loss",
    "policy/entropy",
    "is/kl_gen_learner",
    "is/mean_abs_logp_diff",
    "is/capped_frac",
    "is/rho_max",
    "is/rho_min",
    "optim/grad_norm",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(ranks: int, out: Path) -> None:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(WORKER),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun with {ranks} ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("ddp")
    out = {}
    for ranks in (1, 2):
        torchrun(ranks, root / f"ranks{ranks}")
        out[ranks] = root / f"ranks{ranks}"
    return out


@pytest.mark.slow  # torchrun, twice
@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_ranks_equal_one_rank(runs: dict[int, Path], config: str) -> None:
    one = load_file(str(runs[1] / f"{config}.rank0.safetensors"))
    two = load_file(str(runs[2] / f"{config}.rank0.safetensors"))
    two_rank1 = load_file(str(runs[2] / f"{config}.rank1.safetensors"))
    init = tiny_model().state_dict()
    assert one.keys() == two.keys() == two_rank1.keys()
    moved = max(float((one[k] - init[k]).abs().max()) for k in one)
    assert moved > 1e-2, f"the steps barely changed the weights ({moved:.2e}): the comparison would be vacuous"
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    print(f"{config}: two ranks vs one, largest parameter difference {worst:.2e} (weights moved {moved:.2e})")
    assert worst <= PARITY, f"{config}: two ranks differ from one by {worst:.3e} (> {PARITY})"
    # Every rank holds the same weights (rank 1 took the same optimizer steps).
    assert max(float((two[k] - two_rank1[k]).abs().max()) for k in two) == 0.0


@pytest.mark.slow  # torchrun, twice
def test_ranks_report_the_same_step_metrics(runs: dict[int, Path]) -> None:
    one = json.loads((runs[1] / "report.rank0.json").read_text())
    two = json.loads((runs[2] / "report.rank0.json").read_text())
    follower = json.loads((runs[2] / "report.rank1.json").read_text())
    assert (one["world_size"], two["world_size"]) == (1, 2)
    for config in CONFIGS:
        assert follower[f"{config}/followed"] == len(one[config]) == 3
        for m1, m2 in zip(one[config], two[config], strict=True):
            for key in [*SCORED, "batch/kept_prompts", "staleness/mean"]:
                assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), (config, key)
        # The batches exercise the edge cases the parity has to hold for.
        first = one[config][0]
        assert first["batch/prompts"] == 5 and first["batch/kept_prompts"] == 4
        assert one[config][-1]["batch/prompts"] == 1


def test_prompt_ranges_cover_the_batch_once() -> None:
    from services.learner.distributed import DataParallel

    for world in (1, 2, 3, 4):
        for prompts in range(0, 11):
            ranges = [DataParallel(rank, world).prompt_range(prompts) for rank in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == prompts
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            sizes = [b - a for a, b in ranges]
            assert max(sizes) - min(sizes) <= 1
