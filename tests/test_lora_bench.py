"""The LoRA benchmarks' arithmetic and verdicts on known inputs (the measurements are the benchmarks' own)."""

from __future__ import annotations

from typing import Any

import pytest

from asymptote.codec import Signature
from asymptote.lora import LoraSettings
from benchmarks.lora_memory import memory_figure, planned_peak
from benchmarks.lora_swap import bytes_figures, pause_figure
from services.learner.activations import ModelShape, activation_bytes
from services.learner.memory import adapter_parameters

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


def test_the_planned_cpu_peak_is_the_planners_held_items_and_the_cpu_learners_activations() -> None:
    shape = ModelShape.from_config(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 96,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }
    )
    lora = LoraSettings(rank=4)
    trained = adapter_parameters(shape, lora)
    acts = activation_bytes(
        shape,
        tokens=8 * 40,
        width_tokens=40,
        completion_positions=150,
        compute_bytes=4,
        attention="eager",
        fsdp=False,
        checkpointing=False,
    )
    adapted = planned_peak(shape, lora, rows=8, width=40, completions=150)
    # A float32 base (no gradients, no AdamW) and 16 bytes an adapter parameter; no CUDA reserve on the CPU.
    assert adapted["held"] == 4 * shape.num_parameters + 16 * trained
    assert adapted["training"] == acts.peak and adapted["stepping"] == 4 * trained
    assert adapted["peak"] == adapted["held"] + acts.peak
    full = planned_peak(shape, None, rows=8, width=40, completions=150)
    assert full["held"] == 16 * shape.num_parameters and full["training"] == acts.peak


def test_the_memory_verdict_holds_the_plan_within_20_percent_of_the_measured_peak() -> None:
    planned = {"held": 600, "training": 400, "stepping": 10, "peak": 1_000}
    measured = {"rows": 8, "width": 40}

    def figure(peak: int) -> Any:
        return memory_figure("f", "a step", {**measured, "peak_tensor_bytes": peak}, planned)

    assert figure(900).ratio == pytest.approx(1_000 / 900) and figure(900).met
    assert figure(1_240).met and not figure(1_260).met  # planned 0.79x the measured: under by too much
    assert not figure(800).met  # planned 1.25x: over by too much
