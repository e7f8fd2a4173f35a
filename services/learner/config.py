"""The learner's configuration (one frozen model, loaded by asymptote.config)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from asymptote.config import Frozen, ListenSettings, MeteredServiceSettings
from asymptote.lora import LoraSettings


class LossSettings(Frozen):
    """The policy-gradient loss (docs/recipe.md, "Losses")."""

    name: Literal["cispo", "grpo", "dapo", "gspo"] = "cispo"
    """Loss function: CISPO (ScaleRL), GRPO (PPO clip), DAPO (asymmetric PPO clip), GSPO (sequence ratio)."""
    clip_low: float | None = Field(default=None, ge=0.0, lt=1.0)
    """PPO-style losses: the ratio is clipped to [1 - clip_low, 1 + clip_high] (the verl / PPO
    convention, not CISPO's eps_max). None: the loss's default (GRPO 0.2, DAPO 0.2, GSPO 3e-3)."""
    clip_high: float | None = Field(default=None, gt=0.0)
    """Upper clip of PPO-style losses; None: GRPO 0.2, DAPO 0.28, GSPO 4e-3."""
    tis_cap: float | None = Field(default=None, gt=0.0)
    """GRPO/DAPO: truncated importance sampling, weight sg(min(pi_learner / pi_gen, tis_cap)) with the PPO
    ratio then taken against the learner's pre-step log-probs (docs/recipe.md, "Losses"). None: the PPO ratio is
    taken against the generator's log-probs. CISPO folds this correction in already."""
    eps_max: float = Field(default=4.0, gt=0.0)
    """CISPO: cap on the IS weight itself, w = sg(min(rho, eps_max)). ScaleRL's convention;
    eps_max = 4 equals eps_high = 3 in the MiniMax/verl 1 + eps_high notation."""
    aggregation: Literal["prompt", "sample", "token"] = "prompt"
    """Token-loss aggregation: per prompt (ScaleRL), per sample (GRPO), per token (DAPO)."""
    normalization: Literal["batch", "group", "none"] = "batch"
    """Advantage normalisation: batch std (ScaleRL), group std (GRPO), none (Dr. GRPO)."""

    @property
    def clip(self) -> tuple[float, float]:
        """(low, high) for the PPO-style losses, with each loss's defaults."""
        low, high = {"grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-3, 4e-3)}.get(self.name, (0.2, 0.2))
        return (low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high)

    @model_validator(mode="after")
    def _tis_only_for_ppo(self) -> LossSettings:
        if self.tis_cap is not None and self.name not in ("grpo", "dapo"):
            raise ValueError(f"tis_cap applies to grpo and dapo; {self.name} takes its IS correction otherwise")
        return self

    def warnings(self) -> list[str]:
        """Settings that are valid but likely not what was meant (logged when the learner starts)."""
        if self.name == "gspo" and self.aggregation != "sample":
            return [
                f"loss gspo with aggregation {self.aggregation!r} divides by token counts, so each sequence's "
                "loss weighs by its length: a length-weighted GSPO; aggregation 'sample' gives GSPO's own "
                "objective (the mean over sequences)"
            ]
        return []


class MoeSettings(Frozen):
    """Mixture-of-experts policies (docs/recipe.md, "Mixtures of experts"); a dense model ignores them."""

    routing_replay: bool = True
    """Route every token to the experts the generator recorded for it, in every MoE layer (rollout routing
    replay, R3), with gate weights from the learner's own router logits; a batch without routing is refused.
    false: the learner's routers pick their own experts."""
    load_balancing_coef: float | Literal["model"] = 0.0
    """Weight of the routers' load-balancing loss (the model's own, Switch Transformer's) added to the policy
    loss; "model": the model config's ``router_aux_loss_coef`` (Qwen3-MoE: 0.001). 0: none."""

    @model_validator(mode="after")
    def _non_negative(self) -> MoeSettings:
        if self.load_balancing_coef != "model" and self.load_balancing_coef < 0:
            raise ValueError(f"load_balancing_coef must be >= 0 or 'model', got {self.load_balancing_coef}")
        return self


class OptimizerSettings(Frozen):
    """AdamW with linear warm-up then constant learning rate."""

    lr: float = Field(default=1e-4, gt=0.0)
    """Peak learning rate (a tiny model needs far more than the paper's 5e-7)."""
    warmup_steps: int = Field(default=5, ge=0)
    """Linear warm-up steps."""
    weight_decay: float = Field(default=0.01, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = Field(default=1e-8, gt=0.0)
    """AdamW epsilon (paper: 1e-15 for an 8B model in bf16)."""
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    """Gradient clipping by global norm."""


PAPER_LR = 5e-7
"""ScaleRL's learning rate for its 8B dense model (AdamW, after 100 warm-up steps)."""
LARGE_MODEL_NUM_PARAMETERS = 1_000_000_000
"""From this size on a model is in the paper's class, not the tiny model's."""
LARGE_MODEL_MAX_LR = 1e-5
"""Learning rates above this (20x the paper's) are tiny-model settings on a large model."""


def learning_rate_warning(*, lr: float, num_parameters: int) -> str | None:
    """A warning when a billion-parameter-class model is given a tiny model's learning rate."""
    if num_parameters < LARGE_MODEL_NUM_PARAMETERS or lr <= LARGE_MODEL_MAX_LR:
        return None
    return (
        f"optimizer.lr {lr:g} is a tiny-model learning rate, {lr / PAPER_LR:.0f}x the paper's {PAPER_LR:g} "
        f"for its 8B model, and this model has {num_parameters / 1e9:.1f}B parameters; ScaleRL used AdamW "
        "with lr 5e-7 after 100 warm-up steps, eps 1e-15, weight decay 0.01"
    )


class LearnerConfig(MeteredServiceSettings):
    """Learner: CISPO on the broker's batches, weights served to generators."""

    grpc: ListenSettings = ListenSettings(port=50071)
    """gRPC listener (Learner.PullWeights, Status, health)."""
    http: ListenSettings = ListenSettings(port=9103)
    """HTTP listener (/metrics, /healthz, /readyz)."""
    advertise_host: str = "127.0.0.1"
    """Host generators use to reach this learner's gRPC port (the pod's Service name in Kubernetes)."""
    broker_endpoint: str = "127.0.0.1:50051"
    """host:port of the broker's gRPC service."""
    model_dir: Path
    """Hugging Face model directory with the initial weights and tokenizer (any causal LM that
    transformers' and vLLM's Auto classes load: Llama, Qwen2/Qwen2.5, Qwen3, ...)."""
    trust_remote_code: bool = False
    """Let transformers run Python code shipped in the model directory (off: only built-in architectures)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where each rank trains: auto takes the GPU numbered LOCAL_RANK when CUDA is available, else the CPU."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of the transformer body (auto: bfloat16 on GPUs, float32 on the CPU). Parameters,
    gradients and optimizer state stay float32, and the LM head's matmul and log-softmax always run in
    float32 (ScaleRL's FP32 head)."""
    head_precision: Literal["auto", "fp32", "bf16_fp32_acc"] = "auto"
    """The LM head's matmul: fp32 (float32 operands), or bf16_fp32_acc (bf16 operands, float32 accumulation,
    logits and log-softmax; vLLM's FP32 head of a bf16 engine on GPUs). auto: as a generator computing in
    ``dtype`` does (bf16_fp32_acc in bf16, fp32 in float32), so the importance ratio is 1 at version 0."""
    run_dir: Path = Path("runs/latest")
    """Where metrics.jsonl and checkpoints/ go."""
    loss: LossSettings = LossSettings()
    """The loss."""
    optimizer: OptimizerSettings = OptimizerSettings()
    """The optimizer."""
    batch_prompts: int = Field(default=16, ge=1)
    """Prompt groups per batch (asked of the broker); one optimizer step each unless updates_per_batch > 1."""
    updates_per_batch: int = Field(default=1, ge=1)
    """k of the PPO-off-policy-k baseline: the batch's groups are split into k mini-batches and each gets
    one optimizer step (the policy version advances by k); only the weights after the last are announced,
    so with the broker's mode sync the next batch is generated by exactly those weights. 1: one step per
    batch (ScaleRL, PipelineRL-k). max_steps and checkpoint_every_steps must be multiples of k, and the
    eval every_versions too."""
    max_steps: int = Field(default=200, ge=1)
    """Stop once the weights hold this many optimizer steps in all: a run resumed from a checkpoint
    continues from that checkpoint's step, so steps lost with a crash are trained again and the total
    stays max_steps. The policy version can run ahead of the step after a restart (versions announced
    after the last checkpoint are never reused)."""
    checkpoint_every_steps: int = Field(default=10, ge=1)
    """Checkpoint whenever the step is a multiple of this, and at max_steps; batches are acked to the
    broker only once a checkpoint holds them."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Checkpoints kept on disk."""
    keep_best_checkpoint: bool = True
    """Also keep the checkpoint of the best held-out eval round (the fitter's), for ``export RUN --to DIR --best``."""
    served_versions_kept: int = Field(default=2, ge=1)
    """Policy versions held in memory (each a whole version in the served dtype) to serve to generators:
    a generator that holds one of them pulls only the elements that changed since (a delta), one further
    behind pulls the whole version."""
    batch_wait_s: float = Field(default=10.0, gt=0.0)
    """How long one NextBatch call waits for a full batch before asking again."""
    num_threads: int = Field(default=1, ge=1)
    """torch intra-op threads (one core on the embedded default)."""
    seed: int = 0
    """torch seed."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend when launched by torchrun with several ranks (auto: NCCL when the
    learner's ``device`` is a GPU, else gloo)."""
    dist_timeout_s: float = Field(default=600.0, ge=60.0)
    """How long a rank waits in one collective before it fails and the group restarts. Ranks > 0 wait
    in one while rank 0 waits for data, so rank 0 sends them a heartbeat every ``batch_wait_s``; a
    step's own collectives take far less. Raise it only if one step's slowest collective can take longer."""
    parallelism: Literal["auto", "fsdp", "ddp"] = "auto"
    """How several torchrun ranks share the model: ddp keeps a whole replica (weights, gradients, AdamW
    state) on every rank; fsdp (FSDP2) shards them over the ranks, one group per decoder layer plus the
    root, and gathers one layer at a time. auto: FSDP2 on GPUs, DDP on the CPU (faster there for models
    that fit; see docs/benchmarks.md). One rank runs unwrapped either way."""
    micro_batch_tokens: int | None = Field(default=None, ge=1)
    """Tokens one forward and backward may take: each completion's prompt and completion tokens when
    packed (``packing``), else completions x the batch's padded width. A rank's share of the batch is
    split into micro-batches of this size with gradient accumulation, and the step equals the
    whole-batch step (the loss's denominators come from the whole batch). At least one completion per
    micro-batch. None: the whole share at once."""
    packing: bool = True
    """Lay a micro-batch's sequences end to end in one row, with no padding, each attending only to
    itself (variable-length flash attention on GPUs, attention over right-padded rows on the CPU); the
    log-probs are the padded layout's. false: pad every row to the batch's longest (needed for
    sliding-window attention)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (less
    memory, about one more forward pass of compute)."""
    moe: MoeSettings = MoeSettings()
    """Mixture-of-experts models: routing replay and the routers' load-balancing loss."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter (peft's) in place of the whole model: the base frozen in the compute dtype
    (no float32 copy, gradients or AdamW state for it), float32 adapter weights with AdamW; checkpoints
    hold the adapter and its AdamW state, and generators get the adapter. None: every weight trains."""

    @model_validator(mode="after")
    def _check_updates_per_batch(self) -> LearnerConfig:
        k = self.updates_per_batch
        if k > self.batch_prompts:
            raise ValueError(
                f"updates_per_batch ({k}) exceeds batch_prompts ({self.batch_prompts}): a mini-batch would be empty"
            )
        for name in ("max_steps", "checkpoint_every_steps"):
            if getattr(self, name) % k:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of updates_per_batch ({k})")
        return self

    def warnings(self, num_parameters: int | None = None) -> list[str]:
        """Valid settings that are likely not what was meant; ``num_parameters``: the model's, when known."""
        found = self.loss.warnings()
        if num_parameters is not None:
            lr = learning_rate_warning(lr=self.optimizer.lr, num_parameters=num_parameters)
            found += [lr] if lr else []
        return found
