"""The weight-transfer benchmark in quick mode: a well-formed figure, and the bytes arrive intact.

Checks structure and arithmetic, never the timing target.
"""

from __future__ import annotations

import math
import multiprocessing
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from benchmarks.transfer import bench_digest, bench_transfer
from services.generator.weights import SPARE_FILE


@pytest.mark.slow  # a weight server and its clients, ~10 s
def test_quick_transfer_bench_pulls_the_served_weights(tmp_path: Path) -> None:
    # Children of this worker from before (a session's engine, shared by other modules) are not the bench's.
    before = set(multiprocessing.active_children())
    fig = bench_transfer(quick=True, workdir=tmp_path)
    r = fig.details
    assert fig.name == "weight_transfer_grpc_vs_disk" and fig.unit == "s"
    assert all(isinstance(text, str) and text for text in (fig.baseline, fig.measured, fig.target))
    assert fig.value is not None and fig.ratio is not None
    for key, x in {
        "ratio": fig.ratio,
        "pull_s": fig.value,
        **{k: r[k] for k in ("pull_verify_s", "stage_s", "disk_read_s", "disk_cold_read_s")},
    }.items():
        assert math.isfinite(x) and x > 0, key
    assert fig.ratio == pytest.approx(r["disk_read_s"] / fig.value, rel=1e-9)
    assert fig.met == (fig.ratio >= 0.5)
    assert len(r["pull_s_each"]) == len(r["disk_read_s_each"]) == r["repeats"] == 3

    # float32 weights: four bytes a parameter, about 20 MB, and the file holds them plus its header.
    assert r["bytes"] == 4 * r["num_parameters"]
    assert 15e6 < r["bytes"] < 30e6
    assert r["bytes"] < r["file_bytes"] < r["bytes"] + 100_000

    # What was pulled and staged is exactly what the model directory holds.
    served = load_file(str(tmp_path / "model" / "model.safetensors"))
    # The swapper keeps the loaded version's file as the next pull's buffer: the spare.
    assert sorted(p.name for p in (tmp_path / "staged").iterdir()) == [SPARE_FILE]
    staged = load_file(str(tmp_path / "staged" / SPARE_FILE))
    assert served.keys() == staged.keys()
    for name, array in served.items():
        assert (staged[name] == array).all(), name

    # The weight server's process is gone.
    assert set(multiprocessing.active_children()) - before == set()


def test_the_digest_figure_compares_blake3_with_sha256_over_the_same_bytes() -> None:
    fig = bench_digest(quick=True)
    r = fig.details
    assert fig.name == "weights_digest_blake3_vs_sha256" and fig.unit == "s" and fig.value == r["blake3_s"]
    assert fig.ratio == pytest.approx(r["sha256_s"] / r["blake3_s"], rel=1e-12)
    assert r["bytes"] == 64 << 20 and r["repeats"] == 3
    assert fig.met == (fig.ratio >= 2.0)
