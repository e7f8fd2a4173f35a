"""A two-rank gloo learner equals a one-rank learner (torchrun, the real Trainer), DDP and FSDP2.

The runs take the same steps on the same batches (edge cases included: a
zero-variance prompt, one-token completions, masked tokens, rewards in
{0, 1} and {-1, +1}, a step with fewer prompts than ranks) for four loss
configurations; the parameters must agree to 1e-5 and so must the step
metrics that depend on every rank's scores. Measured (torch 2.13, CPU):
DDP and FSDP2 both within 1.2e-6 of one rank. A checkpoint written by two
FSDP2 ranks resumes on one rank and takes the next step as the two ranks
did (measured within 1e-8), and FSDP2's rank 0 serves the same names and
bytes as an unsharded model holding its weights. FSDP2 with bf16 layers
keeps float32 master weights and scores the first step as float32 does,
within bf16's rounding.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.learner import adapter, checkpoint
from services.learner.distributed import NodeHealth, choose_backend
from services.local import torchrun as launcher

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ddp_worker.py")
sys.path.insert(0, str(WORKER.parent))
from ddp_worker import CONFIGS, tiny_model  # noqa: E402

PARITY = 1e-5
RESUME_PARITY = 1e-6
"""A resumed run against the run that went on: the same layout's arithmetic after the checkpoint
(measured 0 on two ranks, 7.5e-9 on one)."""
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


def torchrun(ranks: int, out: Path, *args: str) -> None:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        launcher.command(ranks, str(WORKER), "--out", str(out), *args),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"torchrun with {ranks} ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


RUNS: dict[str, tuple[int, tuple[str, ...]]] = {
    "one": (1, ()),
    "ddp": (2, ("--parallelism", "ddp")),
    "fsdp": (2, ("--parallelism", "fsdp", "--checkpoint-after", "2")),
    # Uneven micro-batch counts per rank (about 2 completions per micro-batch), layers recomputed.
    "fsdp-micro": (2, ("--parallelism", "fsdp", "--micro-batch-tokens", "30", "--activation-checkpointing")),
    "fsdp-bf16": (2, ("--parallelism", "fsdp", "--dtype", "bfloat16")),
    # A rank-4 adapter over the frozen model, one loss configuration.
    "lora-one": (1, ("--lora-rank", "4", "--configs", "cispo-prompt-batch")),
    "lora-ddp": (2, ("--parallelism", "ddp", "--lora-rank", "4", "--configs", "cispo-prompt-batch")),
    "lora-fsdp": (2, ("--parallelism", "fsdp", "--lora-rank", "4", "--configs", "cispo-prompt-batch")),
}
"""Each run: its ranks and the worker's arguments."""


class Runs:
    """Worker runs made on first use, once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.made:
            if name == "resumed":  # one rank resumes the two FSDP2 ranks' checkpoint after step 2
                torchrun(1, self.root / name, "--resume", str(self["fsdp"]))
            elif name == "resumed-2":  # and two FSDP2 ranks do
                torchrun(2, self.root / name, "--parallelism", "fsdp", "--resume", str(self["fsdp"]))
            else:
                ranks, args = RUNS[name]
                torchrun(ranks, self.root / name, *args)
            self.made[name] = self.root / name
        return self.made[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("dp"))


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow  # torchrun, twice per layout
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "fsdp-micro"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_ranks_equal_one_rank(runs: Runs, layout: str, config: str) -> None:
    one = load_file(str(runs["one"] / f"{config}.rank0.safetensors"))
    two = load_file(str(runs[layout] / f"{config}.rank0.safetensors"))
    init = tiny_model().state_dict()
    moved = largest_difference(one, {k: init[k] for k in one})
    assert moved > 1e-2, f"the steps barely changed the weights ({moved:.2e}): the comparison would be vacuous"
    worst = largest_difference(one, two)
    print(f"{config}, {layout}: two ranks vs one, largest parameter difference {worst:.2e} (weights moved {moved:.2e})")
    assert worst <= PARITY, f"{config}, {layout}: two ranks differ from one by {worst:.3e} (> {PARITY})"
    report = json.loads((runs[layout] / "report.rank0.json").read_text())
    assert report["sharded"] == layout.startswith("fsdp")
    if layout == "ddp":  # every replica holds the same weights (rank 1 took the same optimizer steps)
        assert largest_difference(two, load_file(str(runs[layout] / f"{config}.rank1.safetensors"))) == 0.0


@pytest.mark.slow  # torchrun, once per layout and once on one rank
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_a_lora_on_two_ranks_equals_one_rank_and_leaves_the_base_as_it_was(runs: Runs, layout: str) -> None:
    config = "cispo-prompt-batch"
    init = {k.replace(".base_layer.", "."): t for k, t in tiny_model().state_dict().items()}
    ran = {run: load_file(str(runs[run] / f"{config}.rank0.safetensors")) for run in ("lora-one", f"lora-{layout}")}
    if layout == "ddp":  # the replica on rank 1 too
        ran["lora-ddp rank 1"] = load_file(str(runs["lora-ddp"] / f"{config}.rank1.safetensors"))
    adapters = {run: {k: t for k, t in w.items() if adapter.is_adapter(k)} for run, w in ran.items()}
    for run, weights in ran.items():  # the frozen base as it was built, bit for bit (gathered under FSDP2)
        base = {k.replace(".base_layer.", "."): t for k, t in weights.items() if not adapter.is_adapter(k)}
        assert adapters[run] and base, run
        changed = [k for k, t in base.items() if not torch.equal(t, init[k])]
        assert not changed, f"{run}: the steps changed the frozen base: {changed[:4]}"
    one, two = adapters["lora-one"], adapters[f"lora-{layout}"]
    # B starts at zero (the policy starts as the base): what it holds now the steps put there.
    moved = max(float(t.abs().max()) for k, t in one.items() if ".lora_B." in k)
    assert moved > 1e-3, f"the steps barely changed the adapter ({moved:.2e}): the comparison would be vacuous"
    worst = largest_difference(one, two)
    print(f"LoRA, {layout}: two ranks vs one, largest adapter difference {worst:.2e} (B moved {moved:.2e})")
    assert worst <= PARITY, f"LoRA, {layout}: two ranks differ from one by {worst:.3e} (> {PARITY})"
    if layout == "ddp":
        assert largest_difference(two, adapters["lora-ddp rank 1"]) == 0.0
    reports = [json.loads((runs[run] / "report.rank0.json").read_text()) for run in ("lora-one", f"lora-{layout}")]
    assert reports[1]["sharded"] == (layout == "fsdp")
    # Both serve the adapter's tensors under peft's file names, nothing of the base.
    served = [r[f"{config}/served"]["names"] for r in reports]
    assert served[0] == served[1] and served[0] and all(".lora_" in n for n in served[0]), served


@pytest.mark.slow  # torchrun, twice per layout
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "fsdp-micro"])
def test_ranks_report_the_same_step_metrics(runs: Runs, layout: str) -> None:
    one = json.loads((runs["one"] / "report.rank0.json").read_text())
    two = json.loads((runs[layout] / "report.rank0.json").read_text())
    follower = json.loads((runs[layout] / "report.rank1.json").read_text())
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


@pytest.mark.slow  # torchrun, twice
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("resumed_on", ["resumed", "resumed-2"], ids=["on-1-rank", "on-2-ranks"])
def test_a_two_rank_fsdp_checkpoint_resumes_on_one_rank_and_on_two(runs: Runs, config: str, resumed_on: str) -> None:
    uninterrupted = load_file(str(runs["fsdp"] / f"{config}.rank0.safetensors"))
    resumed = load_file(str(runs[resumed_on] / f"{config}.rank0.safetensors"))
    saved = checkpoint.latest(runs["fsdp"] / "checkpoints" / config)
    assert saved is not None and saved.name == "ckpt-00000002"
    at_checkpoint = checkpoint.read_weights(saved)
    tied = [k for k in at_checkpoint if k not in uninterrupted]  # DCP keeps a tied head under both names
    assert tied in ([], ["lm_head.weight"])
    at_checkpoint = {k: v for k, v in at_checkpoint.items() if k not in tied}
    last_step = largest_difference(uninterrupted, at_checkpoint)
    assert last_step > 1e-3, f"the step after the checkpoint barely moved the weights ({last_step:.2e})"
    worst = largest_difference(uninterrupted, resumed)
    print(f"{config}: {resumed_on} vs two FSDP2 ranks throughout, largest difference {worst:.2e}")
    assert worst <= RESUME_PARITY
    # The resumed run took only the step after the checkpoint, and scored it as the two ranks did.
    resumed_metrics = json.loads((runs[resumed_on] / "report.rank0.json").read_text())[config]
    two = json.loads((runs["fsdp"] / "report.rank0.json").read_text())[config]
    assert len(resumed_metrics) == 1
    for key in SCORED:
        assert resumed_metrics[0][key] == pytest.approx(two[-1][key], rel=1e-5, abs=1e-6), key


@pytest.mark.slow  # torchrun
def test_fsdp_in_bf16_keeps_float32_masters_and_scores_as_float32_does(runs: Runs) -> None:
    """The GPU layout's mixed precision (bf16 layers, float32 root and reductions), run on gloo."""
    one = json.loads((runs["one"] / "report.rank0.json").read_text())
    bf16 = json.loads((runs["fsdp-bf16"] / "report.rank0.json").read_text())
    assert bf16["sharded"] and bf16["master_dtypes"] == ["torch.float32"]
    for config in CONFIGS:
        # The first step scores the same weights: bf16 rounding apart, the same loss and log-probs.
        for key in ("loss", "policy/entropy", "optim/grad_norm"):
            assert bf16[config][0][key] == pytest.approx(one[config][0][key], rel=2e-2, abs=2e-3), (config, key)


@pytest.mark.slow  # torchrun
def test_fsdp_rank0_serves_what_an_unsharded_model_serves(runs: Runs) -> None:
    report = json.loads((runs["fsdp"] / "report.rank0.json").read_text())
    for config in CONFIGS:
        sharded, plain = report[f"{config}/served"], report[f"{config}/served_unsharded"]
        assert sharded["names"] == plain["names"] == sorted(tiny_model().state_dict())
        assert sharded["bytes"] == plain["bytes"] and sharded["dtypes"] == plain["dtypes"]
        assert {"bfloat16", "float32"} == set(sharded["dtypes"].values())
        assert sharded["digest"] == plain["digest"]


def test_prompt_ranges_cover_the_batch_once() -> None:
    from services.learner.distributed import DataParallel

    for world in (1, 2, 3, 4):
        for prompts in range(0, 11):
            ranges = [DataParallel(rank, world).prompt_range(prompts) for rank in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == prompts
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            sizes = [b - a for a, b in ranges]
            assert max(sizes) - min(sizes) <= 1


def test_the_backend_follows_the_learner_s_device() -> None:
    assert choose_backend("auto", "cpu", cuda_available=True) == "gloo"  # a CPU learner on a GPU machine
    assert choose_backend("auto", "auto", cuda_available=True) == "nccl"
    assert choose_backend("auto", "auto", cuda_available=False) == "gloo"
    assert choose_backend("auto", "cuda", cuda_available=True) == "nccl"
    assert choose_backend("gloo", "cuda", cuda_available=True) == "gloo"  # asked for: as asked


def test_a_learner_node_serves_its_own_probes() -> None:
    health = NodeHealth.start("127.0.0.1", 0)
    try:

        def get(path: str) -> int:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health.port}{path}", timeout=5) as r:
                    return int(r.status)
            except urllib.error.HTTPError as exc:
                return int(exc.code)

        assert (get("/healthz"), get("/readyz"), get("/metrics")) == (200, 503, 404)
        health.ready = True  # the rank holds its weights and follows rank 0
        assert (get("/healthz"), get("/readyz")) == (200, 200)
    finally:
        health.stop()
