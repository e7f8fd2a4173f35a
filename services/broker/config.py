"""The broker's configuration (one frozen model, loaded by asymptote.config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asymptote.config import Frozen, ListenSettings, ServiceSettings
from asymptote.tasks import ArithmeticSettings, TaskSettings

ZeroVariance = Literal["drop", "refill", "keep"]
"""What a batch does with groups whose rewards are all equal (BrokerConfig.zero_variance)."""


class SamplingSettings(Frozen):
    """How generators sample train rollouts."""

    group_size: int = Field(default=8, ge=2)
    """G: completions per prompt (advantages need at least 2)."""
    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature; 1.0 makes generator log-probs the sampling distribution."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus truncation; 1.0 is none."""
    max_tokens: int = Field(default=16, ge=1)
    """Completion length cap in tokens."""
    truncated_reward: float | None = 0.0
    """What a single-turn completion cut at max_tokens (no end of sequence) earns, whatever its verifier
    says: 0, a wrong answer's reward, so that not stopping is never rewarded (services/broker/shaping.py).
    None: the verifier's reward. The curriculum's pass rates use the verifier's rewards; a multi-turn
    episode's end is its environment's to score."""
    overlong_cache_tokens: int | None = Field(default=None, ge=1)
    """DAPO's soft overlong punishment, the length-penalty alternative to interruptions: L_cache, the
    tokens before max_tokens (L_max) over which a penalty falling linearly from 0 to -1 is added to a
    completion's reward (-1 beyond L_max). The curriculum's pass rates use the verifier's rewards.
    None: off (ScaleRL)."""

    @model_validator(mode="after")
    def _check_overlong(self) -> SamplingSettings:
        if self.overlong_cache_tokens is not None and self.overlong_cache_tokens > self.max_tokens:
            raise ValueError(
                f"overlong_cache_tokens ({self.overlong_cache_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self


class EvalSettings(Frozen):
    """Held-out evaluation rounds that feed the fitter."""

    every_versions: int = Field(default=10, ge=1)
    """Issue an eval round at each policy version the broker sees that is a multiple of this, and also at
    the first version it sees and at the learner's final one (a learner restart can skip versions, and
    with them a multiple)."""
    num_samples: int = Field(default=4, ge=1)
    """k: samples per held-out prompt; the pass rate is their mean."""
    num_prompts: int | None = Field(default=None, ge=1)
    """Held-out prompts per round (the first this many, the same every round); None: as many as
    ``max_share`` allows, at least ``min_prompts``, at most the whole held-out split."""
    max_share: float = Field(default=0.075, gt=0.0)
    """With num_prompts None: a round's completions at most this share of the train completions sampled
    between two rounds (every_versions x batch_prompts x group_size), so evaluating costs little. 7.5%
    of the completions is about 10% of the generators' time (a run of the embedded default measured
    12.7% at 10%: eval completions run longer, and the first and last rounds have no interval of their
    own)."""
    min_prompts: int = Field(default=64, ge=1)
    """With num_prompts None: the fewest prompts a round takes whatever max_share allows (a point from
    fewer is too noisy to fit)."""
    temperature: float = Field(default=1.0, gt=0.0)
    """Eval sampling temperature (the RL temperature measures what RL optimises)."""


class BrokerConfig(ServiceSettings):
    """Broker: curriculum, admission, batching and the learner's data feed."""

    grpc: ListenSettings = ListenSettings(port=50051)
    """gRPC listener (Broker service and health)."""
    http: ListenSettings = ListenSettings(port=9101)
    """HTTP listener (/metrics, /healthz, /readyz)."""
    task: TaskSettings = ArithmeticSettings()
    """The task the curriculum draws prompts from, with its parameters (splits, sizes, seed). Every task issued
    carries its digest; generators configured with another task refuse it."""
    sampling: SamplingSettings = SamplingSettings()
    """Train rollout sampling."""
    eval: EvalSettings = EvalSettings()
    """Held-out evaluation schedule."""
    batch_prompts: int = Field(default=16, ge=1)
    """B: prompt groups per learner batch (after filtering)."""
    zero_variance: ZeroVariance = "drop"
    """Groups whose completions all got the same reward. drop (ScaleRL): a step takes the next B groups
    and the learner leaves the flat ones out of the loss and its denominators, so the step trains on the
    informative ones among them. refill (DAPO's dynamic sampling): the broker drops them and fills the
    batch with B informative groups, which acts as a larger batch. keep (the paper's "no filtering"
    ablation): they stay in the loss's denominators with zero advantage."""
    mode: Literal["async", "sync"] = "async"
    """async: PipelineRL-k, generators run ahead of the learner by up to k versions.
    sync: conventional on-policy RL; a batch's tasks are issued only once the learner
    has trained the previous batch, generators sample them from the learner's current
    version, and nothing older is admitted (k is taken as 0)."""
    max_staleness_versions: int = Field(default=8, ge=0)
    """k of PipelineRL-k: drop groups whose oldest token is more than k versions behind the learner."""
    max_outstanding_tasks: int | None = Field(default=None, ge=1)
    """Fixed cap on prompt tasks queued or being generated plus groups waiting for the learner; None follows
    the learner's consumption and the generation latency, between one batch and k + 1 batches."""
    pass_rate_retire: float = Field(default=0.9, gt=0.0, le=1.0)
    """No-Positive-Resampling: from the next epoch on, skip prompts whose latest pass rate reached this."""
    seed: int = 0
    """Seed of the per-epoch shuffle of the train split."""
    ack_wait_s: float = Field(default=30.0, gt=1.0)
    """JetStream ack wait on rollout groups; the broker heartbeats held ones well inside it."""
    batch_release_s: float = Field(default=900.0, gt=1.0)
    """A batch handed out and not acked for this long goes back to the queue."""
    routing_bytes_per_token: int = Field(default=0, ge=0)
    """Routing each token of a group carries (an MoE model's generators with routing replay: MoE layers x
    top-k x the ids' bytes, ``asymptote.routing``), counted in the largest group NATS must admit; 0: none
    (a dense model). ``asymptote up`` sets it from the model."""

    @property
    def outstanding_limit(self) -> int:
        if self.mode == "sync":
            return self.batch_prompts
        return self.max_outstanding_tasks or 2 * self.batch_prompts

    def eval_num_prompts(self, heldout: int) -> int:
        """Held-out prompts per eval round, out of ``heldout``: eval.num_prompts, else the max_share rule."""
        if self.eval.num_prompts is not None:
            return min(self.eval.num_prompts, heldout)
        between = self.eval.every_versions * self.batch_prompts * self.sampling.group_size
        allowed = int(self.eval.max_share * between / self.eval.num_samples)
        return min(max(allowed, self.eval.min_prompts), heldout)

    @property
    def staleness_bound(self) -> int:
        """The k the batcher admits by: 0 in synchronous mode."""
        return 0 if self.mode == "sync" else self.max_staleness_versions

    @model_validator(mode="after")
    def _check(self) -> BrokerConfig:
        if self.max_outstanding_tasks is not None and self.max_outstanding_tasks < self.batch_prompts:
            raise ValueError(
                f"max_outstanding_tasks ({self.max_outstanding_tasks}) must be at least batch_prompts "
                f"({self.batch_prompts}), or no batch can ever fill"
            )
        if self.task.name == "multiturn" and self.sampling.overlong_cache_tokens is not None:
            raise ValueError(
                "sampling.overlong_cache_tokens shapes a completion's reward by its length against max_tokens, "
                "which a multi-turn episode does not use (its limits are the task's environment's): leave it unset"
            )
        return self
