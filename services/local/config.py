"""The local stack's configuration: the embedded default in one file.

A few dials for the whole run; each service's own config is derived from
them (ports, paths, the shared task and sampling settings), written into
the run directory and handed to the service process, exactly as a Helm
release renders ConfigMaps.

What a run trains on is a workload, a file of these fields under
examples/workloads/ (services/local/workloads.py): the default, words, is
the shipped dataset file (data/words/), the chat template, math-verify and
interruption length control, the same path a GPU run on GSM8K takes. The
fields a config or a flag gives win over the workload's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ModelWrapValidatorHandler, ValidationError, field_validator, model_validator

from asymptote.config import Frozen, merge
from asymptote.faults import parse as parse_failpoints
from asymptote.lora import LoraSettings
from asymptote.tasks import TaskSettings
from services.broker.config import ZeroVariance
from services.local.workloads import DEFAULT_WORKLOAD, workload

STACK_OWNED: dict[str, tuple[str, ...]] = {
    "broker": ("nats", "prefix", "grpc", "http", "log_format", "task"),
    "learner": (
        "nats",
        "prefix",
        "grpc",
        "http",
        "log_format",
        "model_dir",
        "run_dir",
        "broker_endpoint",
        "advertise_host",
        "lora",
    ),
    "generator": ("nats", "prefix", "grpc", "http", "log_format", "task", "sandbox_pool", "lora"),
    "fitter": ("nats", "prefix", "grpc", "http", "log_format", "run_dir", "run_name"),
}
"""Each service's fields the stack sets itself (its wiring, and the one task every service shares)."""


STACK_DIALS: dict[str, str] = {
    "learner.optimizer.lr": "lr",
    "learner.optimizer.warmup_steps": "warmup_steps",
    "learner.batch_prompts": "batch_prompts",
    "learner.max_steps": "max_steps",
    "learner.checkpoint_every_steps": "checkpoint_every_steps",
    "learner.updates_per_batch": "updates_per_batch",
    "broker.batch_prompts": "batch_prompts",
    "broker.sampling.group_size": "group_size",
    "broker.sampling.max_tokens": "max_tokens",
    "broker.sampling.overlong_cache_tokens": "overlong_cache_tokens",
    "broker.eval.every_versions": "eval_every_versions",
    "broker.eval.num_samples": "eval_num_samples",
    "broker.eval.num_prompts": "eval_num_prompts",
    "broker.mode": "mode",
    "broker.max_staleness_versions": "max_staleness_versions",
    "broker.zero_variance": "zero_variance",
    "broker.seed": "seed",
    "learner.seed": "seed",
    "generator.engine.seed": "seed",
}
"""Service settings that one of StackConfig's own dials sets (section path -> the dial): each setting has one
place, so a size preset, the printed preset line and the run agree on what runs."""


def _dials_in(name: str, section: dict[str, Any]) -> list[str]:
    """The paths of ``section`` (the section of service ``name``) that STACK_DIALS gives to a dial."""
    found = []
    for path in STACK_DIALS:
        head, *rest = path.split(".")
        node: Any = section
        for key in rest:
            node = node.get(key) if isinstance(node, dict) else None
        if head == name and node is not None:
            found.append(path)
    return found


class ServiceSections(Frozen):
    """Settings of each service's own config (docs/configuration.md), merged over what the stack derives
    for it and recorded under ``config/``: every knob of the recipe, e.g. ``learner: {optimizer: {eps:
    1.0e-15}, loss: {eps_max: 4.0}}``, ``broker: {sampling: {temperature: 0.9}}``, ``generator: {engine:
    {max_model_len: 4096}}``, ``fitter: {planned_compute: 1.0e+6}``. Refused: the stack's wiring
    (STACK_OWNED), and what one of the stack's own dials sets (STACK_DIALS: ``lr``, not
    ``learner.optimizer.lr``)."""

    broker: dict[str, Any] = Field(default_factory=dict)
    learner: dict[str, Any] = Field(default_factory=dict)
    generator: dict[str, Any] = Field(default_factory=dict)
    """Applied to every generator."""
    fitter: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> ServiceSections:
        from services.broker.config import BrokerConfig
        from services.fitter.config import FitterConfig
        from services.generator.config import GeneratorConfig
        from services.learner.config import LearnerConfig

        placeholder = Path(".")  # what the stack fills in: only the sections' own fields are checked here
        required: dict[str, tuple[type[Frozen], dict[str, Any]]] = {
            "broker": (BrokerConfig, {}),
            "learner": (LearnerConfig, {"model_dir": placeholder}),
            "generator": (GeneratorConfig, {"engine": {"model_dir": placeholder}}),
            "fitter": (FitterConfig, {}),
        }
        for name, (model, base) in required.items():
            section: dict[str, Any] = getattr(self, name)
            dials = _dials_in(name, section)
            if dials:
                raise ValueError(
                    f"{dials[0]} is the stack's {STACK_DIALS[dials[0]]}: set {STACK_DIALS[dials[0]]} itself (one "
                    f"place for each setting)"
                )
            owned = sorted(set(section) & set(STACK_OWNED[name]))
            if owned or "model_dir" in section.get("engine", {}):
                keys = owned or ["engine.model_dir"]
                raise ValueError(f"{name}.{keys[0]} is set by the stack (its wiring, or StackConfig's own field)")
            try:
                model.model_validate(merge(base, section))
            except ValidationError as exc:
                where = ", ".join(f"{name}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                raise ValueError(where) from None
        return self


class StackConfig(Frozen):
    """``asymptote up``: nats-server plus the four services on loopback, and the sandbox pool for a code task."""

    workload: str = Field(default=DEFAULT_WORKLOAD, pattern=r"^[a-z][a-z0-9+_-]*$")
    """The embedded workload whose file, examples/workloads/<name>.yaml, sets the fields this config does
    not (services/local/workloads.py): words (the default: the shipped word problems, thinking,
    math-verify, length control), arithmetic, words-code, words+code, words-tools, or any file added
    there."""
    run_dir: Path | None = None
    """Run directory; None makes runs/<timestamp>."""
    cache_dir: Path = Path(".cache/asymptote")
    """Where the warm-started model is cached between runs."""
    model_dir: Path | None = None
    """A Hugging Face model directory to train (safetensors weights, config and tokenizer: Llama,
    Qwen2/Qwen2.5, Qwen3, ...); None builds and warm-starts the tiny model (on a dataset task: a BPE
    tokenizer and a warm start on the rows' worked ``solution``). Either way the services read it the
    same way."""
    gpus: int | None = Field(default=None, ge=0)
    """GPUs the stack places its processes on (services/local/placement.py): each generator on
    ``tensor_parallel_size`` GPUs of its own, the learner's torchrun ranks one GPU each on the rest
    (``learner_gpus``), bf16, the KV cache by memory fraction. None: every GPU visible to this process
    (none: the CPU build, the embedded default); 0: the CPU even where GPUs are."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """On GPUs: the GPUs one generator's engine shards the model over."""
    learner_gpus: int | None = Field(default=None, ge=1)
    """On GPUs: the learner's ranks, one GPU each; None (with ``num_generators`` None too): the split with the
    shortest step by ``asymptote plan``'s estimate among those whose ranks fit, for a model directory and a
    card it has figures for (H100, H200, A100, L40S), else half the GPUs (one GPU: shared with the
    generator)."""
    num_generators: int | None = Field(default=None, ge=1, le=16)
    """Generator processes (each one vLLM engine); None: one on the CPU, and on GPUs as many as the GPUs
    beside the learner's hold."""
    learner_ranks: int = Field(default=1, ge=1, le=8)
    """Data-parallel learner ranks (torchrun, gloo) on the CPU; rank 0 is the service, the others follow its
    steps. On GPUs the ranks are the learner's GPUs."""
    max_steps: int = Field(default=600, ge=1)
    """Learner steps (policy versions) of the RL run."""
    batch_prompts: int = Field(default=16, ge=1)
    """B: prompt groups per learner step."""
    group_size: int = Field(default=8, ge=2)
    """G: completions per prompt."""
    max_tokens: int = Field(default=96, ge=1)
    """Completion length cap."""
    max_staleness_versions: int = Field(default=8, ge=0)
    """k of PipelineRL-k."""
    zero_variance: ZeroVariance = "drop"
    """Groups whose rewards are all equal: drop (ScaleRL: out of the loss and its denominators), refill
    (DAPO: the broker replaces them with informative ones) or keep (in the denominators, zero advantage)."""
    mode: Literal["async", "sync"] = "async"
    """async: PipelineRL-k with in-flight weight swaps. sync: conventional on-policy RL for
    comparison (generators drain before every swap, the learner trains only on data of its
    current version)."""
    updates_per_batch: int = Field(default=1, ge=1)
    """k of the PPO-off-policy-k baseline (with mode sync): k optimizer steps per generated batch, one per
    mini-batch; 1: one step per batch."""
    overlong_cache_tokens: int | None = Field(default=None, ge=1)
    """DAPO's soft overlong punishment over the last this many tokens before max_tokens (a length penalty
    added to rewards); None: off."""
    lr: float = Field(default=1e-4, gt=0.0)
    """Learner peak learning rate."""
    warmup_steps: int = Field(default=10, ge=0)
    """Learner linear warm-up steps."""
    eval_every_versions: int = Field(default=30, ge=1)
    """Eval round interval in policy versions."""
    eval_num_samples: int = Field(default=4, ge=1)
    """k samples per held-out prompt in an eval round."""
    eval_num_prompts: int | None = Field(default=None, ge=1)
    """Held-out prompts per eval round (the first this many, every round); None: as many as the broker's
    ``eval.max_share`` allows (BrokerConfig.eval_num_prompts)."""
    checkpoint_every_steps: int = Field(default=10, ge=1)
    """Learner checkpoint interval."""
    seed: int = Field(default=0, ge=0, le=2**31 - 1000)
    """The run's seed: the broker's prompt order, the learner's torch seed and generator i's sampling seed
    (seed + i). The warm-started model is the same whatever the seed: runs of one recipe differ in the RL alone."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter in place of the whole model (``asymptote up --lora-rank N``): the learner's,
    given here once for every service; the learning rate the stack picks is then 10x full fine-tuning's
    (asymptote.lora.LORA_LR_FACTOR). None: every weight trains."""
    task: TaskSettings
    """The task; the workload's when the config gives none (the default: the shipped word problems,
    data/words/)."""
    model: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the tiny model's ModelSpec (whose defaults depend on the task: a Qwen3-shaped model
    with a BPE tokenizer for a dataset task, services.embedded.warmstart.DATASET_MODEL)."""
    warmstart: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the supervised warm start's settings (for a dataset task, over
    services.embedded.warmstart.DATASET_WARMSTART)."""
    report_to: tuple[Literal["tensorboard", "wandb"], ...] = ()
    """Experiment trackers to mirror metrics.jsonl and eval.jsonl to as they grow (services/local/trackers.py):
    tensorboard (event files in <run>/tensorboard), wandb (project WANDB_PROJECT, default asymptote). None
    by default."""
    services: ServiceSections = ServiceSections()
    """Each service's own settings, over what the stack derives (ServiceSections)."""
    pin_cores: bool = True
    """Generators on every core but the last; the learner, broker, fitter and nats-server on the last (Linux, 2+ cores)."""
    nats_auth: bool = True
    """nats-server requires a user and a password made for this run; services get it from their environment."""
    nats_url: str | None = Field(default=None, pattern=r"^(nats|tls)://[^\s]+$")
    """A nats-server (JetStream on) that is already running, instead of one started for this run: several
    runs can share it, each under its own ``prefix``. Its user and password, if it requires them, come from
    ASY_NATS_USER and ASY_NATS_PASSWORD in the environment (never from a file). None: the stack starts its
    own nats-server in the run directory."""
    prefix: str = Field(default="asy", pattern=r"^[a-z][a-z0-9_]*$")
    """The run's namespace on NATS (stream, subject, consumer and bucket names): runs sharing a nats-server
    need different ones."""
    failpoints: str = ""
    """Fault injection: ``name:N,...`` failpoints armed in every service (asymptote/faults.py); empty: none."""

    @field_validator("failpoints")
    @classmethod
    def _check_failpoints(cls, v: str) -> str:
        parse_failpoints(v)
        return v

    max_restarts: int = Field(default=5, ge=0)
    """Restarts of a process in a row (a crash loop: each exit within ``restart_backoff_reset_s`` of its
    start) before the run is declared failed."""
    restart_backoff_s: float = Field(default=1.0, gt=0.0)
    """First restart delay; doubles per restart in a row of the same process, at most 30 s."""
    restart_backoff_reset_s: float = Field(default=120.0, gt=0.0)
    """A process that ran this long before exiting starts its backoff and its count over (kubelet
    does so after 10 minutes)."""
    startup_timeout_s: float = Field(default=300.0, gt=0.0)
    """Longest the stack waits for every service to become ready."""
    final_eval_timeout_s: float = Field(default=300.0, gt=0.0)
    """Longest the stack waits after the last step for the final eval round."""

    @model_validator(mode="wrap")
    @classmethod
    def _workload(cls, data: Any, handler: ModelWrapValidatorHandler[StackConfig]) -> StackConfig:
        # The workload's fields stand under the given ones, and stay out of ``model_fields_set``: what a
        # preset or another workload may still change is what the config itself did not set.
        if not isinstance(data, dict):
            return handler(data)
        name = data.get("workload", DEFAULT_WORKLOAD)
        if not isinstance(name, str):
            raise ValueError(f"workload must be a name, got {name!r}")
        filled = workload(name)
        config = handler({**filled, **data})
        config.__pydantic_fields_set__.difference_update(set(filled) - set(data))
        return config

    @model_validator(mode="after")
    def _own_model(self) -> StackConfig:
        if self.model_dir is not None and (self.model or self.warmstart):
            given = " and ".join(k for k in ("model", "warmstart") if getattr(self, k))
            raise ValueError(f"{given} settings shape the built tiny model; they do not apply with model_dir")
        return self

    @model_validator(mode="after")
    def _ppo_off_policy(self) -> StackConfig:
        k = self.updates_per_batch
        if k > 1 and self.mode != "sync":
            raise ValueError("updates_per_batch > 1 (PPO-off-policy-k) needs mode sync: generators must not run ahead")
        if self.eval_every_versions % k:
            raise ValueError(
                f"eval_every_versions ({self.eval_every_versions}) must be a multiple of updates_per_batch ({k})"
            )
        return self
