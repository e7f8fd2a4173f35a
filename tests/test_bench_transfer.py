"""The weight-transfer benchmark in quick mode: a well-formed figure, and the bytes arrive intact.

Checks structure and arithmetic, never the timing target.
"""

from __future__ import annotations

import math
import multiprocessing
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from asymptote.codec import signature_num_bytes
from benchmarks.figure import Figure, Target
from benchmarks.transfer import MODELS, SyntheticSpec, bench_digest, bench_transfer, projection, tree_depth
from services.generator.fanout import ancestors
from services.generator.weights import SPARE_FILE


@pytest.mark.slow  # a weight server, a relay and their clients, ~20 s
def test_quick_transfer_bench_pulls_the_served_weights(tmp_path: Path) -> None:
    # Children of this worker from before (a session's engine, shared by other modules) are not the bench's.
    before = set(multiprocessing.active_children())
    fig, hop = bench_transfer(quick=True, workdir=tmp_path)
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

    assert r["pull_mb_per_s"] == pytest.approx(r["bytes"] / 1e6 / fig.value, rel=1e-9)
    assert r["read_mb_per_s"] == pytest.approx(r["file_bytes"] / 1e6 / r["disk_read_s"], rel=1e-9)

    # The relay hop: the same version, pulled from a generator that pulled it from the learner first.
    h = hop.details
    assert hop.name == "weight_transfer_relay_hop_vs_disk" and hop.targets[0].bound == 0.4
    assert hop.met == (hop.ratio is not None and hop.ratio >= 0.4)
    assert h["bytes"] == r["bytes"] and h["repeats"] == 3 and h["relay_own_pull_s"] > 0
    assert h["through_hop_s"] == pytest.approx(h["relay_own_pull_s"] + hop.value, rel=1e-9)
    assert h["ratio_through_hop"] == pytest.approx(h["disk_read_s"] / h["through_hop_s"], rel=1e-9)

    # What was pulled and staged, directly and through the relay, is exactly what the model directory holds.
    served = load_file(str(tmp_path / "model-quick" / "model.safetensors"))
    for part in ("quick", "relay"):
        # The swapper keeps the loaded version's file as the next pull's buffer: the spare.
        assert sorted(p.name for p in (tmp_path / part / "staged").iterdir()) == [SPARE_FILE]
        staged = load_file(str(tmp_path / part / "staged" / SPARE_FILE))
        assert served.keys() == staged.keys()
        for name, array in served.items():
            assert (staged[name] == array).all(), (part, name)

    # The weight server's process is gone.
    assert set(multiprocessing.active_children()) - before == set()


def test_the_digest_figure_compares_blake3_with_sha256_over_the_same_bytes() -> None:
    fig = bench_digest(quick=True)
    r = fig.details
    assert fig.name == "weights_digest_blake3_vs_sha256" and fig.unit == "s" and fig.value == r["blake3_s"]
    assert fig.ratio == pytest.approx(r["sha256_s"] / r["blake3_s"], rel=1e-12)
    assert r["bytes"] == 64 << 20 and r["repeats"] == 3
    assert fig.met == (fig.ratio >= 2.0)


def test_the_synthetic_version_has_qwen3s_shapes_and_weighs_1_6_gb() -> None:
    spec = MODELS["1.6gb"]
    assert isinstance(spec, SyntheticSpec)
    sig = spec.signature()
    assert {dtype for dtype, _ in sig.values()} == {"bfloat16"}
    assert len(sig) == 2 + 11 * spec.num_layers
    assert sig["model.embed_tokens.weight"][1] == (151_936, 2048)
    assert sig["model.layers.0.self_attn.k_proj.weight"][1] == (8 * 128, 2048)
    assert sig["model.layers.9.mlp.down_proj.weight"][1] == (2048, 6144)
    layer = 2 * 2048 + 2 * 2048 * 2048 + 2 * 1024 * 2048 + 2 * 128 + 3 * 2048 * 6144
    assert signature_num_bytes(sig) == 2 * (151_936 * 2048 + 2048 + 10 * layer)
    assert 1.6e9 < signature_num_bytes(sig) < 1.7e9


def _rate_figure(name: str, mb_per_s: float, num_bytes: int, relay: bool) -> Figure:
    details = {"model": "m", "bytes": num_bytes, "pull_mb_per_s": mb_per_s}
    if relay:
        details["relay_own_pull_s"] = 1.0
    target = (Target(of="ratio", direction="at least", bound=0.5),)
    return Figure(name=name, value=1.0, unit="s", baseline="-", measured="-", targets=target, details=details)


def test_the_projection_takes_the_largest_versions_rate_and_the_hops_down_the_tree() -> None:
    # 256 generators in a degree-4 tree: generator 255's chain is 62, 14, 2, then the learner.
    assert ancestors(255, 4) == [62, 14, 2]
    assert tree_depth(256, 4) == 4 and tree_depth(4, 4) == 1 and tree_depth(1, 4) == 1
    figures = [
        _rate_figure("small", 100.0, 10**6, False),
        _rate_figure("large", 1000.0, 10**9, False),
        _rate_figure("hop", 500.0, 10**8, True),
    ]
    p = projection(figures, full_bytes=16e9, delta_fraction=0.01, fleet=256, degree=4)
    assert p["depth"] == 4 and p["direct_mb_per_s"] == 1000.0 and p["hop_mb_per_s"] == 500.0
    assert p["full_one_hop_s"] == pytest.approx(16.0)
    assert p["full_tree_s"] == pytest.approx(16.0 + 3 * 32.0)
    assert p["delta_bytes"] == pytest.approx(160e6)
    assert p["delta_one_hop_s"] == pytest.approx(0.16) and p["delta_tree_s"] == pytest.approx(0.16 + 3 * 0.32)
