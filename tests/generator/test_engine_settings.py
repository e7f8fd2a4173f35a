"""The generator's engine settings reach vLLM, and the platform refuses what it cannot run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from asymptote.errors import ConfigError
from asymptote.lora import LoraSettings
from services.generator.config import EngineSettings
from services.generator.engine import Engine, check_lora, check_platform, engine_args
from tests.helpers.refusals import refusal

REPO = Path(__file__).resolve().parents[2]
# Importing vLLM's engine arguments takes ~20 s here: the slow tier.
pytestmark = pytest.mark.slow


def test_every_setting_reaches_the_engine_args() -> None:
    s = EngineSettings(
        model_dir=Path("/models/m"),
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=64,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.8,
        kv_cache_memory_bytes=None,
        enable_prefix_caching=False,
        quantization="fp8",
        seed=7,
    )
    args = engine_args(s)
    got = {
        k: getattr(args, k)
        for k in (
            "model",
            "tokenizer",
            "load_format",
            "dtype",
            "max_model_len",
            "max_num_seqs",
            "tensor_parallel_size",
            "gpu_memory_utilization",
            "kv_cache_memory_bytes",
            "enable_prefix_caching",
            "quantization",
            "seed",
            "logprobs_mode",
            "hf_overrides",
        )
    }
    assert got == {
        "model": "/models/m",
        "tokenizer": "/models/m",
        "load_format": "safetensors",
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "max_num_seqs": 64,
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.8,
        "kv_cache_memory_bytes": None,
        "enable_prefix_caching": False,
        "quantization": "fp8",
        "seed": 7,
        "logprobs_mode": "processed_logprobs",
        "hf_overrides": {"head_dtype": "float32"},  # the FP32 head of a bf16 engine
    }


@pytest.mark.parametrize(
    ("dtype", "fp32_lm_head", "overrides"),
    [
        ("bfloat16", True, {"head_dtype": "float32"}),
        ("float16", True, {"head_dtype": "float32"}),
        ("auto", True, {"head_dtype": "float32"}),
        ("bfloat16", False, {}),
        ("float32", True, {}),  # the head is float32 already
    ],
)
def test_the_fp32_head_is_asked_for_below_float32(dtype: str, fp32_lm_head: bool, overrides: dict[str, str]) -> None:
    s = EngineSettings(model_dir=Path("/m"), dtype=dtype, fp32_lm_head=fp32_lm_head)  # type: ignore[arg-type]
    assert engine_args(s).hf_overrides == overrides


def test_quantization_is_refused_on_the_cpu_build_by_name() -> None:
    check_platform(EngineSettings(model_dir=Path("/m")))  # unquantized: fine
    with pytest.raises(ConfigError, match=r"^engine.quantization 'fp8': vLLM's CPU build serves unquantized"):
        check_platform(EngineSettings(model_dir=Path("/m"), quantization="fp8"))


def test_gpu_staging_places_are_refused_on_the_cpu_build() -> None:
    check_platform(EngineSettings(model_dir=Path("/m"), swap_staging="mapped"))
    for place in ("pinned", "device"):
        with pytest.raises(
            ConfigError, match=rf"^engine.swap_staging '{place}' stages for a GPU; .*use auto or mapped"
        ):
            check_platform(EngineSettings(model_dir=Path("/m"), swap_staging=place))  # type: ignore[arg-type]


def test_a_name_vllm_does_not_know_is_refused_with_the_accepted_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        check_platform(EngineSettings(model_dir=Path("/m"), quantization="fp9"))
    message = str(caught.value)
    assert message.startswith("engine.quantization 'fp9' is not a vLLM quantization method; accepted: ")
    assert {"fp8", "awq", "gptq"} <= set(message.split("accepted: ")[1].split(", "))


def test_on_a_gpu_platform_vllm_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    platform = type(current_platform)
    monkeypatch.setattr(platform, "device_type", "cuda")
    monkeypatch.setattr(platform, "device_name", "cuda")
    # CUDA keeps no list: a method vLLM knows passes, an unknown one does not.
    check_platform(EngineSettings(model_dir=Path("/m"), quantization="fp8"))
    check_platform(EngineSettings(model_dir=Path("/m"), swap_staging="pinned"))  # staging for a GPU: fine
    with pytest.raises(ConfigError, match=r"^engine.quantization 'fp9' is not a vLLM quantization method"):
        check_platform(EngineSettings(model_dir=Path("/m"), quantization="fp9"))
    # A platform with a list (ROCm, XPU): vLLM's refusal, under the setting's name.
    monkeypatch.setattr(platform, "supported_quantization", ["fp8"])
    check_platform(EngineSettings(model_dir=Path("/m"), quantization="fp8"))
    with pytest.raises(ConfigError, match=r"^engine.quantization 'awq': awq quantization is currently not supported"):
        check_platform(EngineSettings(model_dir=Path("/m"), quantization="awq"))


async def test_the_engine_refuses_quantization_before_starting_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(2, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    # Were the engine reached, this import would raise and the test fail loudly.
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", None)
    with pytest.raises(ConfigError, match=r"^engine.quantization 'fp8': vLLM's CPU build serves unquantized"):
        await Engine(EngineSettings(model_dir=tmp_path, quantization="fp8")).start()


@pytest.mark.parametrize(("rank", "slot"), [(1, 1), (4, 8), (8, 8), (9, 16), (512, 512)])
def test_a_lora_gives_the_engine_one_slot_of_the_smallest_rank_that_holds_it(rank: int, slot: int) -> None:
    args = engine_args(EngineSettings(model_dir=Path("/m")), LoraSettings(rank=rank))
    assert (args.enable_lora, args.max_lora_rank, args.max_loras) == (True, slot, 1)
    assert args.model == "/m"  # the base, loaded once
    assert not engine_args(EngineSettings(model_dir=Path("/m"))).enable_lora


def test_a_lora_the_engine_cannot_serve_as_trained_is_refused_naming_the_setting(tmp_path: Path) -> None:
    plain = EngineSettings(model_dir=tmp_path)
    check_lora(plain, None)
    check_lora(plain, LoraSettings(rank=8))
    with pytest.raises(ConfigError, match=r"^lora.rank 1024 is above vLLM's largest max_lora_rank, 512"):
        check_lora(plain, LoraSettings(rank=1024))
    with pytest.raises(ConfigError, match=r"^lora with engine.quantization 'fp8': the learner trains the adapter"):
        check_lora(EngineSettings(model_dir=tmp_path, quantization="fp8"), LoraSettings(rank=8))
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "awq"}}')
    with pytest.raises(ConfigError, match=r"^lora with engine.model_dir .*: its base is awq-quantized"):
        check_lora(plain, LoraSettings(rank=8))


def test_the_generator_command_refuses_quantization_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "generator.yaml"
    config.write_text(f"engine:\n  model_dir: {tmp_path}\n  quantization: awq\n")
    assert "engine.quantization 'awq'" in refusal("generator", config)


def test_the_chart_schema_takes_the_engine_settings() -> None:
    import helm_python as helm

    values = {
        "generator": {
            "gpus": 2,
            "config": {
                "engine": {
                    "tensor_parallel_size": 2,
                    "gpu_memory_utilization": 0.85,
                    "kv_cache_memory_bytes": None,
                    "quantization": "fp8",
                    "fp32_lm_head": True,
                }
            },
        }
    }
    with helm.Chart.load(REPO / "deploy" / "helm" / "asymptote") as chart:
        chart.validate_schema(values)
        with pytest.raises(helm.HelmValuesError, match="tensor_parallel_size"):
            chart.validate_schema({"generator": {"config": {"engine": {"tensor_parallel_size": 0}}}})
