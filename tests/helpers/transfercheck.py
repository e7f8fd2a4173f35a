"""What the quick weight-transfer bench must have measured and pulled (``benchmarks.transfer``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from safetensors.numpy import load_file

from services.generator.weights import SPARE_FILE


def check_transfer_figures(fig: dict[str, Any], hop: dict[str, Any], workdir: Path) -> None:
    """The quick transfer bench's two figures (as bench.json holds them) are well formed, and what it pulled
    and staged in ``workdir``, directly and through the relay, is what its model directory holds.

    Checks structure and arithmetic, never the timing targets."""
    r = fig["details"]
    assert fig["unit"] == "s"
    assert all(isinstance(fig[k], str) and fig[k] for k in ("baseline", "measured", "target"))
    assert fig["value"] is not None and fig["ratio"] is not None
    for key, x in {
        "ratio": fig["ratio"],
        "pull_s": fig["value"],
        **{k: r[k] for k in ("pull_verify_s", "stage_s", "disk_read_s", "disk_cold_read_s")},
    }.items():
        assert math.isfinite(x) and x > 0, key
    assert fig["ratio"] == pytest.approx(r["disk_read_s"] / fig["value"], rel=1e-9)
    assert fig["met"] == (fig["ratio"] >= 0.5)
    assert len(r["pull_s_each"]) == len(r["disk_read_s_each"]) == r["repeats"] == 3

    # float32 weights: four bytes a parameter, about 20 MB, and the file holds them plus its header.
    assert r["bytes"] == 4 * r["num_parameters"]
    assert 15e6 < r["bytes"] < 30e6
    assert r["bytes"] < r["file_bytes"] < r["bytes"] + 100_000

    assert r["pull_mb_per_s"] == pytest.approx(r["bytes"] / 1e6 / fig["value"], rel=1e-9)
    assert r["read_mb_per_s"] == pytest.approx(r["file_bytes"] / 1e6 / r["disk_read_s"], rel=1e-9)

    # The relay hop: the same version, pulled from a generator that pulled it from the learner first.
    h = hop["details"]
    assert hop["targets"][0]["bound"] == 0.4
    assert hop["met"] == (hop["ratio"] is not None and hop["ratio"] >= 0.4)
    assert h["bytes"] == r["bytes"] and h["repeats"] == 3 and h["relay_own_pull_s"] > 0
    assert h["through_hop_s"] == pytest.approx(h["relay_own_pull_s"] + hop["value"], rel=1e-9)
    assert h["ratio_through_hop"] == pytest.approx(h["disk_read_s"] / h["through_hop_s"], rel=1e-9)

    # What was pulled and staged, directly and through the relay, is exactly what the model directory holds.
    served = load_file(str(workdir / "model-quick" / "model.safetensors"))
    for part in ("quick", "relay"):
        # The swapper keeps the loaded version's file as the next pull's buffer: the spare.
        assert sorted(p.name for p in (workdir / part / "staged").iterdir()) == [SPARE_FILE]
        staged = load_file(str(workdir / part / "staged" / SPARE_FILE))
        assert served.keys() == staged.keys()
        for name, array in served.items():
            assert (staged[name] == array).all(), (part, name)
