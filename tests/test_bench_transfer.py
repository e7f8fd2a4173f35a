"""The weight-transfer benchmark's digest figure and projection arithmetic, never the timing targets.

The quick transfer section itself runs in the quick bench (tests/test_bench.py), which checks its figures
and the bytes it pulled with ``tests.helpers.transfercheck``.
"""

from __future__ import annotations

import pytest

from asymptote.codec import signature_num_bytes
from benchmarks.figure import Figure, Target
from benchmarks.transfer import MODELS, SyntheticSpec, bench_digest, projection, tree_depth
from services.generator.fanout import ancestors


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
