"""``python -m benchmarks.gpu --device cpu --quick``: the GPU script's code, run on the CPU so it cannot rot.

The full run is for one GPU (docs/benchmarks.md has its figures); here the
same parts run on a tiny model and their numbers are checked against what
the workload implies.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from benchmarks.gpu import BENCH_FILE_NAME, QUICK, long_tailed_groups, main, pack_rows


def test_the_quick_run_measures_every_part(tmp_path: Path) -> None:
    assert main(["--output", str(tmp_path), "--device", "cpu", "--quick"]) == 0
    report = json.loads((tmp_path / BENCH_FILE_NAME).read_text())
    parts = report["parts"]
    assert set(parts) == {"step", "activations", "fsdp", "staging"} and all(p["ok"] for p in parts.values())
    assert report["device"] == "cpu" and report["quick"] and report["within_budget"]

    step = parts["step"]
    groups = long_tailed_groups(QUICK, QUICK.prompts)
    real = sum(len(g.prompt_token_ids) + len(c.token_ids) for g in groups for c in g.completions)
    rows = sum(len(g.completions) for g in groups)
    width = QUICK.prompt_len + max(len(c.token_ids) for g in groups for c in g.completions)
    assert step["real_tokens"] == real and step["padded_tokens"] == rows * width
    assert math.isclose(step["padding_share_padded"], 1 - real / (rows * width))
    for name in ("bare", "learner_packed", "learner_padded"):
        assert step[f"{name}_tokens_per_s"] == real / step[f"{name}_step_s"] > 0
    assert step["learner_packed_vs_bare"] == step["bare_step_s"] / step["learner_packed_step_s"]
    assert step["head_fp32_s"] > 0 and 0 < step["head_fp32_share_of_packed_step"] < 1
    assert step["bare_mfu"] is None  # no peak for a CPU

    fsdp = parts["fsdp"]
    assert fsdp["backend"] == "gloo" and fsdp["broadcast"] and fsdp["dcp_round_trip"]
    assert len(fsdp["grad_norms"]) == 2 and all(math.isfinite(n) and n > 0 for n in fsdp["grad_norms"])
    # Served in bf16: two bytes a parameter, the tied head once.
    assert fsdp["serve_bytes"] == 2 * parts_parameters(QUICK)
    # On the CPU no pages are locked: the learner's own path, the same version.
    assert fsdp["serve_pinned_buffers"] == 0 and fsdp["serve_pinned_digest"] == fsdp["serve_digest"]
    assert len(fsdp["serve_s"]) == len(fsdp["serve_pinned_s"]) == 3
    assert fsdp["dcp_bytes"] > 3 * 4 * parts_parameters(QUICK)  # float32 weights and AdamW's two moments

    staging = parts["staging"]
    assert staging["bytes"] == QUICK.staging_bytes
    assert math.isclose(staging["pageable_to_device_pause_16gb_s"] * staging["pageable_to_device_gb_per_s"], 16.0)
    # The generator's staging on the CPU: the version mapped where the pull wrote it, nothing copied.
    assert staging["auto_placement"] == "mapped" and staging["mapped_gb_per_s"] > 0
    assert abs(staging["generator_staging_bytes"] - QUICK.staging_bytes) <= 8 * 1024 * 2
    assert not any(k.startswith("stage_") for k in staging)
    assert set(parts["activations"]) >= {f"T{t}_plain_s" for t in QUICK.activation_lengths}


def parts_parameters(shape: object) -> int:
    from benchmarks.gpu import qwen3_model

    model = qwen3_model(shape, torch.device("cpu"))  # type: ignore[arg-type]
    return sum(p.numel() for p in model.parameters())


def test_the_bare_steps_rows_hold_every_sequence_once_within_the_budget() -> None:
    groups = long_tailed_groups(QUICK, QUICK.prompts)
    rows = pack_rows(groups, QUICK.pack_tokens, torch.device("cpu"))
    seqs = sorted(list(g.prompt_token_ids) + list(c.token_ids) for g in groups for c in g.completions)
    found = []
    for ids, pos, lengths in zip(rows.input_ids, rows.position_ids, rows.lengths):
        assert ids.shape[1] == int(lengths.sum()) <= max(QUICK.pack_tokens, int(lengths.max()))
        start = 0
        for n in lengths.tolist():
            assert pos[0, start : start + n].tolist() == list(range(n))  # positions restart per sequence
            found.append(ids[0, start : start + n].tolist())
            start += n
    assert sorted(found) == seqs and rows.tokens == sum(map(len, seqs))
