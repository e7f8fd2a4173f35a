"""The generator's configuration (one frozen model, loaded by asymptote.config)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from asymptote.config import Frozen, ListenSettings, MeteredServiceSettings


class EngineSettings(Frozen):
    """The vLLM engine (AsyncLLM) this generator runs."""

    model_dir: Path
    """Hugging Face model directory with the initial (version 0) weights and tokenizer."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Engine compute dtype."""
    max_model_len: int | None = Field(default=None, ge=8)
    """Prompt plus completion tokens per sequence; None takes the model's maximum."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Sequences the engine batches at once (continuous batching)."""
    kv_cache_memory_bytes: int = Field(default=128 * 1024 * 1024, ge=1024 * 1024)
    """KV cache size; set explicitly because on CPU vLLM's fraction-of-memory default fails for small values."""
    enforce_eager: bool = True
    """No CUDA graphs / compilation (required for fast start on CPU)."""
    seed: int = 0
    """Engine sampling seed."""


class GeneratorConfig(MeteredServiceSettings):
    """Generator: vLLM rollouts, verifier scoring, in-flight weight swaps."""

    grpc: ListenSettings = ListenSettings(port=50061)
    """gRPC listener (Generator service and health)."""
    http: ListenSettings = ListenSettings(port=9102)
    """HTTP listener (/metrics, /healthz, /readyz)."""
    engine: EngineSettings
    """The vLLM engine."""
    max_inflight_groups: int = Field(default=32, ge=1)
    """Prompt groups generated concurrently (each is G sequences in the engine)."""
    task_ack_wait_s: float = Field(default=30.0, gt=1.0)
    """JetStream ack wait of a leased task; heartbeats extend it while generating."""
    swap_mode: Literal["inflight", "drain"] = "inflight"
    """inflight: pause keeping requests and KV cache, swap, resume (PipelineRL); drain: finish running requests first."""
    weights_dir: Path = Path("/dev/shm/asymptote")
    """Scratch folder for pulled weight versions (tmpfs keeps the reload in memory)."""
