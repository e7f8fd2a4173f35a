"""The generator's configuration (one frozen model, loaded by asymptote.config)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from asymptote.config import Frozen, ListenSettings, MeteredServiceSettings
from asymptote.lora import LoraSettings
from asymptote.sandbox import PoolClientSettings
from asymptote.tasks import ArithmeticSettings, TaskSettings


class EngineSettings(Frozen):
    """The vLLM engine (AsyncLLM) this generator runs."""

    model_dir: Path
    """Hugging Face model directory with the initial (version 0) weights and tokenizer."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Engine compute dtype (auto: the checkpoint's). Weight updates arrive in the model directory's dtypes."""
    fp32_lm_head: bool = True
    """Run the LM head's matmul and log-softmax in float32 when the engine computes in bf16/fp16 (ScaleRL's
    FP32 head, as the learner does; vLLM's head_dtype override). No effect in a float32 engine."""
    max_model_len: int | None = Field(default=None, ge=8)
    """Prompt plus completion tokens per sequence; None takes the model's maximum."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Sequences the engine batches at once (continuous batching)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs one engine shards the model over (vLLM tensor parallelism; give the pod as many GPUs)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    """Fraction of each GPU's memory vLLM may use, weights and KV cache together; used when
    kv_cache_memory_bytes is None."""
    kv_cache_memory_bytes: int | None = Field(default=128 * 1024 * 1024, ge=1024 * 1024)
    """KV cache size in bytes; when set it wins over gpu_memory_utilization. Keep it set on CPU, where
    vLLM's fraction-of-memory sizing fails for small values; set None on GPUs to size by fraction."""
    enable_prefix_caching: bool = True
    """Reuse the KV of shared prompt prefixes (the G samples of a group share their prompt)."""
    prefix_cache_salt: Literal["version", "none"] = "version"
    """version: each request's cached prefix KV is keyed by the policy version it was submitted under, so
    after a weight swap no new request reuses KV computed by older weights (sequences in flight keep theirs).
    none: prefixes are shared across versions (off-policy KV that k does not bound; for comparison only)."""
    quantization: str | None = None
    """vLLM quantization method of the served model (e.g. fp8, awq, gptq); None serves it unquantized.
    Refused at start where the platform cannot run it (vLLM's CPU build: none)."""
    enforce_eager: bool = True
    """No CUDA graphs / compilation (required for fast start on CPU)."""
    swap_staging: Literal["auto", "mapped", "pinned", "device"] = "auto"
    """Where a new version waits, while generation goes on, for the pause that loads it. mapped: the
    tmpfs pages the pull wrote (no copy; the only choice on the CPU). pinned: page-locked host buffers
    kept from swap to swap (one version's bytes per engine worker, so tensor_parallel_size x the model).
    device: spare GPU memory, so the paused load is a device-to-device copy. auto: mapped on the CPU; on
    GPUs device when the version fits in free memory with 1 GiB to spare, else pinned."""
    swap_prepack: bool = True
    """CPU engines: load and pack each new version into a twin of the model while generating, so a swap's
    pause only hands the packed weights over (100M parameters: about 10x shorter). Costs one more copy of the
    model in memory from staging to the swap. No effect on GPUs (nothing is packed there) or quantized models."""
    seed: int = 0
    """Engine sampling seed."""
    routing_replay: bool | None = None
    """Record the experts an MoE model routes every token to, for the learner to replay (R3): vLLM's own
    capture on GPUs, the generator's on the CPU build. None: on for an MoE model, off for a dense one."""


class FanoutSettings(Frozen):
    """The weight fan-out tree: generators re-serve the version they hold to the generators below them."""

    degree: int = Field(default=0, ge=0)
    """Generators each node serves: generator i pulls from generator i // degree - 1 and the first `degree`
    from the learner, so the learner sends each version `degree` times whatever the fleet's size.
    0: every generator pulls from the learner."""
    index: int | None = Field(default=None, ge=0)
    """This generator's place in the tree (0-based); None: the number its host name ends with (a
    StatefulSet pod's ordinal)."""
    peer_endpoint: str = "asymptote-generator-{index}.asymptote-generator:50061"
    """host:port of generator {index}'s gRPC server: a StatefulSet pod under its headless Service in
    Kubernetes; on one host a loopback port per index, e.g. "127.0.0.1:5{index:04d}"."""
    peer_timeout_s: float = Field(default=30.0, gt=0.0)
    """How long a pull from one peer may take, waiting for the peer to get the version included, before
    the next generator up the tree (and last the learner) is asked."""

    @field_validator("peer_endpoint")
    @classmethod
    def _formats_an_index(cls, value: str) -> str:
        try:
            value.format(index=0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"peer_endpoint must be a host:port template naming only {{index}}: {exc}") from exc
        if "{index" not in value:
            raise ValueError("peer_endpoint must contain {index} (each generator's is its own)")
        return value


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
    eval_hold_versions: int = Field(default=4, ge=0)
    """While an eval round is sampled at the engine's version, newer versions wait unless the learner is
    more than this many ahead (so a round measures the version it names; train groups sampled meanwhile are
    this much staler at most); 0: swap at once."""
    task: TaskSettings = ArithmeticSettings()
    """The broker's task, the same settings: a dataset task's prompt template and verifier apply here (its files
    are not read). A task message whose task digest is another task's is dead-lettered."""
    lora: LoraSettings | None = None
    """The run trains a LoRA adapter (the learner's ``lora``, the same settings): the engine loads the base
    from ``engine.model_dir`` once and every version is an adapter over it, loaded in place into one LoRA
    slot; a version without its adapter is refused, and nothing is sampled before the first adapter is
    loaded. None: every version is the whole model."""
    weights_dir: Path = Path("/dev/shm/asymptote")
    """Scratch folder for pulled weight versions (tmpfs keeps the reload in memory)."""
    fanout: FanoutSettings = FanoutSettings()
    """Where weight versions come from: the learner, or peers in a fan-out tree."""
    sandbox_pool: PoolClientSettings | None = None
    """A code task's programs run in this sandbox pool (``asymptote sandbox-pool``) instead of this machine's
    sandbox; the verdicts are the same. Not part of the task (nor of its digest): it says where scoring runs."""
