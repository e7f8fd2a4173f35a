"""The LoRA benchmarks' arithmetic and verdicts on known inputs (the measurements are the benchmarks' own)."""

from __future__ import annotations

from typing import Any

import pytest

from asymptote.codec import Signature
from asymptote.lora import LoraSettings
from benchmarks.lora_swap import bytes_figures, pause_figure

BASE: Signature = {
    "model.embed_tokens.weight": ("float32", (32, 8)),
    "model.layers.0.self_attn.q_proj.weight": ("float32", (8, 8)),
    "model.layers.0.mlp.down_proj.weight": ("float32", (8, 16)),
    "model.layers.0.input_layernorm.weight": ("float32", (8,)),
}
"""Two adapted linear layers (q 8x8, down 8x16); the embeddings and the norm get none."""


def test_the_adapters_bytes_are_its_float32_tensors_and_at_8b_about_one_percent_of_the_parameters() -> None:
    lora = LoraSettings(rank=2)
    # q: A 2x8 + B 8x2 = 32; down: A 2x16 + B 8x2 = 48; 80 float32 parameters.
    small, qwen = bytes_figures(full_bytes=4_000, adapter_bytes=320, base=BASE, lora=lora)
    assert (small.value, small.ratio, small.details["predicted_bytes"], small.met) == (320, 0.08, 320, True)
    assert bytes_figures(4_000, 324, BASE, lora)[0].met is False  # more on the wire than the adapter holds
    # Qwen3-8B at rank 32: 36 layers x 32 x 75,776 adapter parameters in float32 against 8.19B in bf16.
    _, qwen = bytes_figures(4_000, 320, BASE, LoraSettings(rank=32))
    assert qwen.details["adapter_parameters"] == 87_293_952
    assert (qwen.value, qwen.details["full_bytes"]) == (4 * 87_293_952, 2 * 8_190_735_360)
    assert qwen.details["parameter_share"] == pytest.approx(0.010658, abs=1e-6)
    assert qwen.ratio == pytest.approx(0.021315, abs=1e-6) and qwen.met


def run(pauses: list[float], version_bytes: int) -> dict[str, Any]:
    return {"pause_s": pauses, "version_bytes": version_bytes, "carried": [3, 5, 4]}


def test_the_adapters_pause_is_held_to_the_whole_weight_swaps() -> None:
    adapter, full = run([0.01, 0.03, 0.02], 26_000_000), run([0.05, 0.04, 0.06], 400_000_000)
    figure = pause_figure(adapter, full, 32, "loaded in the pause", "loaded")
    assert figure.name == "lora_swap_pause_vs_full_loaded_100m_r32"
    assert (figure.value, figure.ratio, figure.met) == (0.02, pytest.approx(0.4), True)
    assert "3-5 sequences in flight" in figure.measured
    assert pause_figure(full, adapter, 32, "prepacked", "prepacked").met is False  # 2.5x
