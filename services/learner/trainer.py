"""One learner step: rollout groups in, an optimizer step and metrics out.

Owns turning a batch of ``RolloutGroup`` messages into padded tensors
(never re-tokenising: the generator's token ids are used as they are), the
forward pass (``model.PolicyForward``: FP32 LM head), the loss call, the
optimizer and scheduler, and the step metrics of docs/recipe.md, "The learner's step". Knows
nothing about gRPC or NATS.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.optimizer import _get_scalar_dtype
from transformers import PreTrainedModel

from asymptote.codec import Signature
from asymptote.contracts.v1 import rollout_pb2, services_pb2
from asymptote.errors import ConfigError, ModelError, PayloadError
from asymptote.faults import failpoint
from asymptote.lora import LoraSettings
from asymptote.routing import decode_rows
from services.learner import adapter, checkpoint
from services.learner.attention import has_sliding_window, is_packed, use_packed_attention
from services.learner.checkpoint import Checkpointer, Restored
from services.learner.config import LossSettings, MoeSettings, OptimizerSettings
from services.learner.distributed import DataParallel
from services.learner.losses import (
    RatioStats,
    aggregation_weights,
    batch_counts,
    group_advantages,
    log_ratio,
    policy_loss,
)
from services.learner.model import CPU_FP32, PackedBatch, PolicyForward, Precision, fill_from_dir, materialize, pack
from services.learner.routing import MoeLayout, RouterReplay, RouterReport, routing_dtype
from services.learner.sharding import (
    Parallelism,
    checkpoint_activations,
    clip_grad_norm,
    full_state,
    full_tensor,
    load_full_state,
    resolve_parallelism,
    shard,
)
from services.learner.weights import served_parts, source_keys, stored_layout


@dataclass(frozen=True)
class TrainingState:
    """The whole state a step needs, gathered onto rank 0 (``Trainer.full_state``)."""

    weights: dict[str, torch.Tensor]
    """Parameters and buffers by state-dict name, a tied weight under its first name only."""
    optimizer: dict[str, Any]
    """The optimizer's state dict, keyed by parameter name."""
    scheduler: dict[str, Any]
    """The learning-rate scheduler's state dict."""


@dataclass(frozen=True)
class StepInputs:
    batch: PackedBatch
    logp_gen: torch.Tensor  # [N, T] generator log-probs (0 on padding)
    loss_mask: torch.Tensor  # [N, T] 1 where the token is in the loss
    token_versions: torch.Tensor  # [N, T] policy version that sampled each token
    rewards: torch.Tensor  # [P, G] one reward per episode (a single-turn completion is an episode)
    prompt_index: torch.Tensor  # [N]
    reward_index: torch.Tensor  # [N] each row's episode in rewards flattened (row n is episode n in single-turn)
    temperature: torch.Tensor  # [N]
    truncated: torch.Tensor  # [N] bool
    num_prompts: int
    num_taken: int  # groups the step consumed: num_prompts, plus the flat ones the broker dropped to refill it
    keep_zero_variance: bool  # flat groups count in the loss's denominators (the broker's zero_variance: keep)


def collate(
    groups: Sequence[rollout_pb2.RolloutGroup],
    pad_id: int,
    header: services_pb2.BatchHeader | None = None,
    routing: MoeLayout | None = None,
) -> StepInputs:
    """Lay out a batch of groups; raises PayloadError on inconsistent groups.

    Every completion is one row, with its own prompt when it carries one
    (a multi-turn episode's later sequence) and the group's otherwise. A
    group's rewards are its episodes': a completion that continues the
    episode before it shares that episode's reward and advantage (its row's
    ``reward_index``), so the group mean counts each episode once. Every
    group of a batch has the same number of episodes.

    ``header``: the broker's for the batch, which says how many groups the
    step took and whether flat groups count in the loss (None: a batch
    assembled here, every group taken, flat ones left out).

    ``routing``: an MoE model's layout (``Trainer.routing_layout``) when its
    routers replay the generator's routing: every group must carry routing
    of that layout (``asymptote.routing``), laid out with the tokens
    (``model.pack``). None: any routing the groups carry is left out.
    PayloadError names the group whose routing is missing or does not fit.
    """
    if not groups:
        raise PayloadError("empty batch")
    group_size = _num_episodes(groups[0])
    prompts: list[list[int]] = []
    completions: list[list[int]] = []
    rows_gen: list[list[float]] = []
    rows_mask: list[list[int]] = []
    rows_version: list[list[int]] = []
    rewards: list[list[float]] = []
    prompt_index: list[int] = []
    reward_index: list[int] = []
    temperature: list[float] = []
    truncated: list[bool] = []
    routed: list[torch.Tensor] = []
    for p, g in enumerate(groups):
        num_episodes = _num_episodes(g)
        if num_episodes != group_size:
            raise PayloadError(f"group {g.group_id} has {num_episodes} episodes, the batch has {group_size}")
        rewards.append([c.reward for c in g.completions if not c.continues_episode])
        if routing is not None:
            routed.extend(group_routing(g, routing))
        episode = -1
        for c in g.completions:
            n = len(c.token_ids)
            episode += 0 if c.continues_episode else 1
            reward_index.append(p * group_size + episode)
            prompts.append(list(c.prompt_token_ids or g.prompt_token_ids))
            completions.append(list(c.token_ids))
            rows_gen.append(list(c.logprobs))
            rows_mask.append(list(c.loss_mask) if c.loss_mask else [1] * n)
            versions = [0] * n
            for span in c.version_spans:
                versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
            rows_version.append(versions)
            prompt_index.append(p)
            temperature.append(g.task.sampling.temperature or 1.0)
            truncated.append(c.truncated)
    batch = pack(prompts, completions, pad_id, routing=routed if routing is not None else None)
    width = batch.completion_mask.shape[1]
    return StepInputs(
        batch=batch,
        logp_gen=_rows(rows_gen, width, torch.float32),
        loss_mask=_rows(rows_mask, width, torch.float32) * batch.completion_mask,
        token_versions=_rows(rows_version, width, torch.long),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        prompt_index=torch.tensor(prompt_index, dtype=torch.long),
        reward_index=torch.tensor(reward_index, dtype=torch.long),
        temperature=torch.tensor(temperature, dtype=torch.float32),
        truncated=torch.tensor(truncated, dtype=torch.bool),
        num_prompts=len(groups),
        num_taken=len(groups) if header is None else header.num_groups + header.num_zero_variance,
        keep_zero_variance=header is not None and header.keep_zero_variance,
    )


def group_routing(group: rollout_pb2.RolloutGroup, layout: MoeLayout) -> list[torch.Tensor]:
    """Each completion's recorded routing, [prompt + completion (- 1) tokens, MoE layers, k] in the smallest dtype
    of the model's experts; PayloadError naming the group for none, or for routing of another layout."""
    gid = group.group_id
    rows = decode_rows(group)  # names the group and completion of rows that do not fit their tokens
    if rows is None:
        raise PayloadError(
            f"group {gid} carries no routing, but the model is a mixture of experts and the learner's "
            "moe.routing_replay is on: the generators must record it (their routing_replay), or set it false"
        )
    spec, want = group.routing, (len(layout.moe_layers), layout.top_k, layout.num_experts)
    if (spec.num_moe_layers, spec.top_k, spec.num_experts) != want:
        raise PayloadError(
            f"group {gid}: routing of {spec.num_moe_layers} MoE layers x top-{spec.top_k} of {spec.num_experts} "
            f"experts, the model has {want[0]} x top-{want[1]} of {want[2]}"
        )
    dtype = routing_dtype(layout.num_experts)
    return [torch.from_numpy(r).to(dtype) for r in rows]


def _num_episodes(group: rollout_pb2.RolloutGroup) -> int:
    return sum(not c.continues_episode for c in group.completions)


def _rows(rows: Sequence[Sequence[float]], width: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


@dataclass(frozen=True)
class _Scored:
    """One micro-batch's scores and loss, as the step metrics read them."""

    loss: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    logp_gen: torch.Tensor
    score_mask: torch.Tensor
    stats: RatioStats

    @classmethod
    def merge(cls, parts: Sequence[_Scored]) -> _Scored:
        """One rank's micro-batches as one: losses summed, rows stacked, IS-ratio stats over all loss tokens
        (on the device: nothing here waits for it)."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.logp.shape[1] for p in parts)
        assert all(p.logp.shape[1] == width for p in parts), "micro-batches keep the batch's padding"
        stats = RatioStats.merge([p.stats for p in parts])
        return cls(
            loss=torch.stack([p.loss for p in parts]).sum(),
            logp=torch.cat([p.logp for p in parts]),
            entropy=torch.cat([p.entropy for p in parts]),
            logp_gen=torch.cat([p.logp_gen for p in parts]),
            score_mask=torch.cat([p.score_mask for p in parts]),
            stats=stats,
        )


def _no_sync(policy: torch.nn.Module) -> contextlib.AbstractContextManager[object]:
    """DDP: keep a micro-batch's gradients local until the last one (FSDP2 reduce-scatters each into its shards)."""
    if isinstance(policy, torch.nn.parallel.DistributedDataParallel):
        return policy.no_sync()
    return contextlib.nullcontext()


def _by_budget(rows: list[int], cost: list[int], budget: int | None) -> list[list[int]]:
    """``rows`` in order, cut into runs whose costs add up to at most ``budget`` (a row over it alone)."""
    if budget is None:
        return [rows] if rows else []
    runs: list[list[int]] = []
    spent = budget + 1
    for row in rows:
        if spent + cost[row] > budget:
            runs.append([])
            spent = 0
        runs[-1].append(row)
        spent += cost[row]
    return runs


def select_rows(batch: PackedBatch, rows: torch.Tensor) -> PackedBatch:
    """The completions ``rows`` of a packed batch, padding unchanged."""
    return PackedBatch(
        input_ids=batch.input_ids[rows],
        attention_mask=batch.attention_mask[rows],
        position_ids=batch.position_ids[rows],
        prompt_len=batch.prompt_len,
        completion_mask=batch.completion_mask[rows],
        routing=None if batch.routing is None else batch.routing[rows],
        routed=None if batch.routed is None else batch.routed[rows],
    )


class Trainer:
    """Optimizer steps on whole batches, over one process or the ranks of ``dp``.

    Every rank holds the whole batch; advantages, the keep mask and the
    aggregation weights come from all of it, and each rank differentiates
    only its share of the prompts (``DataParallel.prompt_range``), in
    micro-batches of at most ``micro_batch_tokens`` padded tokens whose
    gradients add up to the share's. Several ranks keep a DDP replica each
    or FSDP2 shards (``parallelism``, see ``sharding.resolve_parallelism``).
    An MoE model's routers replay the batch's recorded routing (``moe``,
    ``routing.RouterReplay``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        loss: LossSettings,
        opt: OptimizerSettings,
        dp: DataParallel | None = None,
        precision: Precision = CPU_FP32,
        parallelism: Parallelism = "auto",
        micro_batch_tokens: int | None = None,
        activation_checkpointing: bool = False,
        packing: bool = True,
        lora: LoraSettings | None = None,
        moe: MoeSettings | None = None,
    ) -> None:
        if micro_batch_tokens is not None and micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be at least 1 (or None: whole batch), got {micro_batch_tokens}")
        self.model = model
        self.lora = lora
        """The adapter trained in place of the whole model; None: every parameter trains."""
        self._sources: dict[str, str] | None = None
        """Served name -> state-dict entry (``_served_sources``)."""
        if lora is not None:
            adapter.add_adapter(model, lora, precision)
        self.moe = moe or MoeSettings()
        # Before activation checkpointing wraps the layers: their recompute then replays the same experts.
        self.replay = RouterReplay.install(model)
        """An MoE model's routers; None for a dense model."""
        self.load_balancing_coef = self._load_balancing_coef()
        self.base: dict[str, str] | None = None
        """With ``lora``: the base model's directory and digest, as the checkpoints record them (``start``)."""
        if packing:
            if has_sliding_window(model.config):
                raise ConfigError(
                    f"{type(model).__name__} uses sliding-window attention, which packed sequences do not "
                    "compute: set the learner's packing: false"
                )
            use_packed_attention(model)
        self.precision = precision
        self.dp = dp or DataParallel()
        self.micro_batch_tokens = micro_batch_tokens
        if activation_checkpointing:
            checkpoint_activations(model)
        self.sharded = self.dp.distributed and resolve_parallelism(parallelism, precision.device) == "fsdp"
        policy = PolicyForward(model, precision, self.replay)
        # A model built on the meta device (``model.empty_model``) is allocated after sharding, so
        # each rank only ever holds its own shards; ``start`` then reads its weights.
        if self.sharded:
            shard(policy, model, precision)
        materialize(model, precision.device)
        if lora is not None:
            adapter.initialize(model)  # the same whole adapter on every rank, cut to its shard under FSDP2
        self.policy: torch.nn.Module = policy if self.sharded else self.dp.wrap(policy)
        self._released = False
        self.checkpointer: Checkpointer | None = None
        """Where ``save`` writes (set on every rank by the learner before the first save)."""
        self.loss_settings = loss
        self.opt_settings = opt
        # After sharding: the optimizer holds (and keeps float32 state for) this rank's shards, of the
        # parameters that train (with a LoRA the adapter's only: the frozen base has no AdamW state).
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        warmup = max(opt.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)) if warmup else 1.0
        )

    def _load_balancing_coef(self) -> float:
        """``moe.load_balancing_coef`` as a number (``model``: the model config's ``router_aux_loss_coef``)."""
        setting = self.moe.load_balancing_coef
        coef = getattr(self.model.config, "router_aux_loss_coef", None) if setting == "model" else setting
        if coef is None:
            raise ConfigError(f"moe.load_balancing_coef 'model': {type(self.model).__name__}'s config has none")
        if coef and self.replay is None:
            raise ConfigError(f"moe.load_balancing_coef is {coef}, but {type(self.model).__name__} has no routers")
        return float(coef)

    @property
    def routing_layout(self) -> MoeLayout | None:
        """What ``collate`` takes for this model: its routers' layout while they replay recorded routing, else None."""
        return self.replay.layout if self.replay is not None and self.moe.routing_replay else None

    def check_routing(self, inputs: StepInputs) -> StepInputs:
        """The inputs this model trains on: PayloadError (one line) for an MoE batch without routing while
        ``moe.routing_replay`` is on, or with routing that does not fit the model; routing dropped when off."""
        batch, name = inputs.batch, type(self.model).__name__
        if self.replay is None or not self.moe.routing_replay:
            return inputs if batch.routing is None else replace(inputs, batch=replace(batch, routing=None, routed=None))
        if batch.routing is None or batch.routed is None:
            raise PayloadError(
                f"the batch carries no routing, but {name} is a mixture of experts and the learner's "
                "moe.routing_replay is on: the generators must record each token's experts (or set it false)"
            )
        self.replay.check(batch.routing, batch.routed, name)
        return inputs

    # -- data parallelism: rank 0 leads, the other ranks follow ---------------
    #
    # Rank 0 broadcasts what it is about to do before every collective piece
    # of work: a step; under FSDP2 also gathering the weights or the state.

    def start(self, model_dir: Path | None, resume: Path | None = None) -> Restored | None:
        """Every rank: the weights to start from, rank 0 deciding which.

        Rank 0 names a checkpoint (``resume``) or none; every rank then reads
        its own part: of the checkpoint (its shards, with AdamW and scheduler
        state), else of ``model_dir``'s stored tensors (``model_dir`` None: the
        model's weights as they are, e.g. random). With a LoRA the base always
        comes from ``model_dir`` and a checkpoint holds the adapter and its AdamW
        state only (ModelError for a checkpoint of another kind, shape or base).
        Nothing whole is gathered or sent between ranks. Returns the
        checkpoint's counters when one was read.
        """
        named = self.dp.broadcast(None if resume is None else str(resume)) if self.dp.distributed else resume
        if named is None or self.lora is not None:  # a LoRA's checkpoint holds the adapter, over this base
            if model_dir is not None:
                fill_from_dir(self.model, model_dir)
                if self.lora is not None and self.dp.is_main:
                    self.base = {"model_dir": str(Path(model_dir).resolve()), "digest": adapter.base_digest(model_dir)}
        if named is None:
            return None
        restored = checkpoint.read(Path(named))
        self._check_kind(restored)
        if restored.legacy:
            weights, optimizer = checkpoint.load_legacy(restored.path)
            load_full_state(self.model, self.optimizer, weights, optimizer, False, restored.stepped)
        else:
            if restored.stepped:
                self._allocate_optimizer_state()
            state = self.state_dict(with_optimizer=restored.stepped)
            checkpoint.load_state(restored.path, state)
            set_model_state_dict(self.model, state["model"], options=self._state_options())
            if restored.stepped:
                set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        self.scheduler.load_state_dict(restored.scheduler)
        return restored

    def _check_kind(self, restored: Restored) -> None:
        """ModelError when a checkpoint is not of this trainer's kind: whole weights for a LoRA, an adapter
        of another shape or another base, or an adapter for full training."""
        path = restored.path
        if self.lora is None:
            if restored.lora is not None:
                raise ModelError(f"checkpoint {path} holds a LoRA adapter; this learner trains every weight (no lora)")
            return
        if restored.lora is None:
            raise ModelError(f"checkpoint {path} holds whole weights; this learner trains a LoRA (lora is set)")
        saved = LoraSettings.model_validate(restored.lora)
        if saved != self.lora:
            raise ModelError(
                f"lora: checkpoint {path} trained {saved.model_dump()}, the config says {self.lora.model_dump()}"
            )
        if self.base is not None and restored.base is not None and restored.base["digest"] != self.base["digest"]:
            raise ModelError(
                f"model_dir {self.base['model_dir']}: not the base checkpoint {path} trained its adapter over "
                f"({restored.base['model_dir']}, digest {restored.base['digest'][:12]}, this one {self.base['digest'][:12]})"
            )

    def _state_options(self) -> StateDictOptions:
        """The model's part of a checkpoint: every tensor, or with a LoRA the adapter's only."""
        # strict off for a LoRA: the frozen base is not in the dict (DCP's load already refuses a missing adapter key).
        return StateDictOptions(ignore_frozen_params=self.lora is not None, strict=self.lora is None)

    def _allocate_optimizer_state(self) -> None:
        """AdamW's state for every parameter, zero, as its first step would make it (for a checkpoint to
        load into). torch's own way takes a step with zero gradients, which allocates a gradient per
        parameter on the way: a third more memory at a resume than training ever holds."""
        for group in self.optimizer.param_groups:
            on_device = group["capturable"] or group["fused"]  # where AdamW keeps its step count
            for param in group["params"]:
                if not param.requires_grad or param in self.optimizer.state:
                    continue
                state = {
                    "step": torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=param.device)
                    if on_device
                    else torch.tensor(0.0, dtype=_get_scalar_dtype()),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                self.optimizer.state[param] = state

    def init_random(self) -> None:
        """Initialise the weights as the model's constructor would (a model built on the meta device)."""
        self.model.init_weights()
        if self.lora is not None:
            adapter.initialize(self.model)

    def state_dict(self, with_optimizer: bool | None = None) -> dict[str, Any]:
        """This rank's model and AdamW state by parameter name, as a checkpoint holds them (its shards
        under FSDP2). ``with_optimizer`` None: when the optimizer has taken a step."""
        weights = get_model_state_dict(self.model, options=self._state_options())
        if self.lora is not None:  # a tied head's alias of the frozen embeddings passes ignore_frozen_params
            weights = {k: v for k, v in weights.items() if adapter.is_adapter(k)}
        state: dict[str, Any] = {"model": weights}
        if with_optimizer if with_optimizer is not None else bool(self.optimizer.state):
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state

    def meta(
        self, version: int, step: int, samples_trained: int = 0, trained_group_ids: Sequence[str] = ()
    ) -> checkpoint.Meta:
        """What a checkpoint of the current weights records beside them."""
        return checkpoint.Meta(
            version=version,
            step=step,
            samples_trained=samples_trained,
            trained_group_ids=list(trained_group_ids),
            scheduler=self.scheduler.state_dict(),
            stepped=bool(self.optimizer.state),
            world_size=self.dp.world_size,
            layout="fsdp" if self.sharded else "ddp" if self.dp.distributed else "single",
            lora=None if self.lora is None else self.lora.model_dump(mode="json"),
            base=self.base,
        )

    def save(self, version: int, meta: checkpoint.Meta) -> None:
        """Rank 0: start checkpoint ``version`` on every rank (``Checkpointer.begin``); commit it with
        ``checkpointer.finish`` once written."""
        if self.dp.distributed:
            self.dp.broadcast(("checkpoint", version))
        self._save(version, meta)

    def _save(self, version: int, meta: checkpoint.Meta | None = None) -> None:
        assert self.checkpointer is not None, "the learner sets a checkpointer before the first save"
        self.checkpointer.begin(version, self.state_dict(), meta)

    def heartbeat(self) -> None:
        """Rank 0: let the other ranks know it is alive while it waits for data (their collective returns)."""
        if self.dp.distributed:
            self.dp.broadcast(("heartbeat",))

    def follow(self) -> int:
        """Ranks > 0: do what rank 0 broadcasts (steps; under FSDP2 also gathers) until it releases them;
        returns the steps taken."""
        steps = 0
        while (message := self.dp.broadcast(None)) is not None:
            kind, *args = message
            if kind == "step":
                self._step(*args)
                steps += 1
            elif kind == "weights":
                for _ in self._gathered(*args):
                    pass
            elif kind == "state":
                full_state(self.model, self.optimizer)
            elif kind == "checkpoint":
                self._save(*args)
            elif kind == "heartbeat":
                pass
            else:
                raise AssertionError(f"rank 0 sent an unknown message {kind!r}")
        return steps

    def release_followers(self) -> None:
        """Rank 0: tell the other ranks there are no more steps."""
        if self.dp.distributed and self.dp.is_main and not self._released:
            self.dp.broadcast(None)
            self._released = True

    def close(self) -> None:
        """Finish the checkpoint in flight (rank 0 commits it), and drop the DDP wrapper and the
        checkpoints' process group: they must be gone before the process group is destroyed."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.policy = PolicyForward(self.model, self.precision, self.replay)
        gc.collect()

    def full_state(self) -> TrainingState:
        """Rank 0: the whole training state on the CPU (FSDP2 ranks join the gathers): for tests and tools
        that compare whole weights; checkpoints never gather (``save``)."""
        if self.sharded:
            self.dp.broadcast(("state",))
        weights, optimizer = full_state(self.model, self.optimizer)
        return TrainingState(weights, optimizer, self.scheduler.state_dict())

    def served_tensors(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0: the whole tensors ``names``, one parameter at a time, for ``WeightStore.snapshot_tensors``.

        ``names`` are the served names: the model directory's tensors (an MoE
        layer's fused experts are served as the stored per-expert tensors,
        ``weights.stored_layout``, each fused parameter gathered once), or a
        LoRA adapter's file names. Under FSDP2 each parameter is gathered as it
        is asked for (the other ranks join every gather), so no rank holds more
        than one gathered parameter besides what the caller keeps. KeyError
        before any gather for a name the model lacks.
        """
        state = self.model.state_dict()
        keys = source_keys(names, self._served_sources(), state)
        if self.sharded:
            self.dp.broadcast(("weights", keys))
        return self._served(set(names), keys, state)

    def _served_sources(self) -> dict[str, str]:
        """Served name -> the state-dict entry it comes from: a LoRA's adapter under peft's file names, else the
        model directory's tensors (``weights.stored_layout``); computed once, the model's layout never changes."""
        if self._sources is None:
            self._sources = adapter.file_names(self.model) if self.lora is not None else stored_layout(self.model)
        return self._sources

    def served_signature(self) -> Signature | None:
        """With a LoRA, what it serves: the adapter's tensors by peft's file names, in float32 (the engine
        casts them to its own dtype); None: the model directory's tensors, in their stored dtypes."""
        if self.lora is None:
            return None
        state = self.model.state_dict()
        return {name: ("float32", tuple(state[key].shape)) for name, key in self._served_sources().items()}

    def _served(
        self, names: set[str], keys: list[str], state: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0: each of ``keys`` gathered, then served as those of ``names`` it holds."""
        if self.lora is not None:
            served = {key: name for name, key in self._served_sources().items()}
            for key, tensor in self._gathered(keys, state):
                yield served.get(key, key), tensor
            return
        for key, tensor in self._gathered(keys, state):
            yield from served_parts(self.model, names, key, tensor)

    def _gathered(
        self, keys: list[str], state: dict[str, torch.Tensor] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """State-dict entries ``keys``, each whole (gathered under FSDP2: every rank calls this alike)."""
        state = self.model.state_dict() if state is None else state
        for key in keys:
            yield key, full_tensor(state[key].detach())

    def step(self, inputs: StepInputs, learner_version: int) -> dict[str, float]:
        """One optimizer step on ``inputs`` (rank 0 hands them to the other ranks); returns the step's metrics.

        PayloadError, before anything is trained, for routing that does not fit (``check_routing``)."""
        inputs = self.check_routing(inputs)
        if self.dp.distributed:
            self.dp.broadcast(("step", inputs, learner_version))
        return self._step(inputs, learner_version)

    def micro_batches(self, inputs: StepInputs) -> list[tuple[torch.Tensor, float]]:
        """This rank's rows of the batch in micro-batches, each with 1.0, or 0.0 for a stand-in.

        Every rank gets as many micro-batches as the rank with the most (each
        forward and backward is a collective); a rank with fewer rows, or none,
        scores row 0 with zero weight instead.
        """
        budget = self.micro_batch_tokens
        if is_packed(self.model):  # a row costs its real tokens
            cost = inputs.batch.attention_mask.sum(1).tolist()
        else:  # every row costs the batch's padded width
            cost = [inputs.batch.input_ids.shape[1]] * inputs.prompt_index.numel()
        shares = []
        for rank in range(self.dp.world_size):
            first, last = DataParallel(rank, self.dp.world_size).prompt_range(inputs.num_prompts)
            rows = ((inputs.prompt_index >= first) & (inputs.prompt_index < last)).nonzero().squeeze(1).tolist()
            shares.append(_by_budget(rows, cost, budget))
        mine = shares[self.dp.rank]
        count = max(1, *(len(s) for s in shares))
        return [
            (torch.tensor(mine[i], dtype=torch.long), 1.0) if i < len(mine) else (torch.zeros(1, dtype=torch.long), 0.0)
            for i in range(count)
        ]

    def padding_share(self, inputs: StepInputs, chunks: list[tuple[torch.Tensor, float]]) -> float:
        """The share of the tokens this rank's forward passes take for ``chunks`` that are padding (a
        stand-in's all are): none packed, up to the batch's padded width a row otherwise."""
        mask = inputs.batch.attention_mask
        real = sum(int(mask[rows].sum()) for rows, live in chunks if live)
        if is_packed(self.model):
            total = sum(int(mask[rows].sum()) for rows, _ in chunks)
        else:
            total = sum(rows.numel() for rows, _ in chunks) * mask.shape[1]
        return 1.0 - real / max(total, 1)

    def _step(self, inputs: StepInputs, learner_version: int) -> dict[str, float]:
        started = time.perf_counter()
        s = self.loss_settings
        self.model.train()
        advantages, keep = group_advantages(
            rewards=inputs.rewards, normalization=s.normalization, keep_zero_variance=inputs.keep_zero_variance
        )
        per_completion_adv = advantages.reshape(-1)[inputs.reward_index]
        # Prompts not kept (flat ones, unless the batch keeps them) are out of
        # the loss (docs/recipe.md, "Advantages"): masking their tokens keeps them out of the
        # aggregation's denominators too.
        all_loss_mask = inputs.loss_mask * keep[inputs.prompt_index, None].to(inputs.loss_mask.dtype)
        counts = batch_counts(rewards=inputs.rewards, keep=keep, loss_mask=all_loss_mask, num_taken=inputs.num_taken)
        # The whole batch's weights: each micro-batch of each rank sums its rows' share of one loss.
        all_weights = aggregation_weights(
            mask=all_loss_mask, prompt_index=inputs.prompt_index, aggregation=s.aggregation
        )
        train = bool(keep.any())
        chunks = self.micro_batches(inputs)
        padding_share = self.padding_share(inputs, chunks)
        self.optimizer.zero_grad(set_to_none=True)
        parts: list[_Scored] = []
        reports: list[RouterReport] = []
        num_real = int(inputs.batch.attention_mask.sum())
        for i, (rows, live) in enumerate(chunks):
            sync = contextlib.nullcontext() if i == len(chunks) - 1 else _no_sync(self.policy)
            with sync, torch.set_grad_enabled(train):
                report = RouterReport(load_balancing=self.load_balancing_coef > 0)
                logp, entropy = self.policy(select_rows(inputs.batch, rows), inputs.temperature[rows], report)
                # Everything the loss and the scores read lives where the model does.
                device = logp.device
                loss_mask = (all_loss_mask[rows] * live).to(device)
                loss, stats = policy_loss(
                    name=s.name,
                    logp=logp,
                    logp_gen=inputs.logp_gen[rows].to(device),
                    advantages=per_completion_adv[rows].to(device),
                    mask=loss_mask,
                    prompt_index=inputs.prompt_index[rows].to(device),
                    aggregation=s.aggregation,
                    eps_max=s.eps_max,
                    clip=s.clip,
                    tis_cap=s.tis_cap,
                    weights=(all_weights[rows] * live).to(device),
                )
                objective = loss
                if report.load_balancing_loss is not None:
                    # Each micro-batch's own loss, weighed by its share of the batch's tokens: they add up to
                    # about the whole batch's (the loss is a product of means, so not exactly).
                    share = live * int(inputs.batch.attention_mask[rows].sum()) / max(num_real, 1)
                    report.load_balancing_loss = report.load_balancing_loss * share
                    objective = loss + self.load_balancing_coef * report.load_balancing_loss
                if train:
                    # DDP and FSDP2 average gradients over ranks; the batch's loss is the sum of the shards'.
                    (objective * self.dp.world_size).backward()
                if i == 0:  # mid-step on every rank: the collectives of the step are under way
                    failpoint(f"learner.step.backward.rank{self.dp.rank}", learner_version)
            if live:
                reports.append(report)
            parts.append(
                _Scored(
                    loss=loss.detach(),
                    logp=logp.detach(),
                    entropy=entropy,
                    logp_gen=inputs.logp_gen[rows].to(device),
                    score_mask=(inputs.loss_mask[rows] * live).to(device),
                    stats=stats,
                )
            )
        if train:
            grad_norm = clip_grad_norm(self.model.parameters(), self.opt_settings.max_grad_norm)
            if math.isfinite(grad_norm):
                self.optimizer.step()
            self.scheduler.step()
        else:
            grad_norm = 0.0
        compute_s = time.perf_counter() - started

        scored = self._scored_stats(_Scored.merge(parts))
        mask = inputs.loss_mask.bool()
        num_tokens = int(inputs.batch.completion_mask.sum())
        staleness = (learner_version - inputs.token_versions)[mask]
        hist = Counter(int(x) for x in staleness.tolist())
        metrics = {
            "reward/mean": float(inputs.rewards.mean()),
            "reward/pass_rate": float((inputs.rewards > 0).float().mean()),
            "batch/prompts": float(inputs.num_prompts),
            **counts,
            "batch/samples": float(inputs.rewards.numel()),
            "batch/tokens": float(num_tokens),
            "batch/truncation_rate": float(inputs.truncated.float().mean()),
            "optim/grad_norm": grad_norm,
            "dist/ranks": float(self.dp.world_size),
            "optim/lr": float(self.scheduler.get_last_lr()[0]),
            "time/compute_s": compute_s,
            "perf/tokens_per_s": num_tokens / compute_s if compute_s > 0 else 0.0,
            "perf/padding_share": padding_share,
            "perf/samples_per_s": inputs.rewards.numel() / compute_s if compute_s > 0 else 0.0,
            "batch/min_token_version": float(inputs.token_versions[mask].min()) if mask.any() else 0.0,
            "batch/max_token_version": float(inputs.token_versions[mask].max()) if mask.any() else 0.0,
            "staleness/mean": float(staleness.float().mean()) if staleness.numel() else 0.0,
            "staleness/max": float(staleness.max()) if staleness.numel() else 0.0,
            **{f"staleness/hist/{k}": float(v) for k, v in sorted(hist.items())},
            **scored,
            **self._router_stats(reports),
        }
        return metrics

    def _router_stats(self, reports: Sequence[RouterReport]) -> dict[str, float]:
        """An MoE model's router metrics, summed over micro-batches and ranks: the share of replayed decisions
        where the learner's own top-k is another set of experts, and the load-balancing loss."""
        if self.replay is None:
            return {}
        zero = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            local = torch.stack(
                [
                    sum((r.differing.double().cpu() for r in reports if r.differing is not None), zero),
                    sum((r.decisions.double().cpu() for r in reports if r.decisions is not None), zero),
                    sum(
                        (
                            r.load_balancing_loss.detach().double().cpu()
                            for r in reports
                            if r.load_balancing_loss is not None
                        ),
                        zero,
                    ),
                ]
            )
            differing, decisions, balance = self.dp.sum(local).tolist()
        metrics = {"moe/routing_differs_frac": differing / decisions if decisions else 0.0}
        if self.load_balancing_coef > 0:
            metrics["moe/load_balancing_loss"] = balance
        return metrics

    def _scored_stats(self, part: _Scored) -> dict[str, float]:
        """Metrics of the learner's own scores, summed over ranks (one process: as they are)."""
        loss, logp, logp_gen, entropy = part.loss, part.logp, part.logp_gen, part.entropy
        score_mask, stats = part.score_mask, part.stats
        mask = score_mask.bool()
        with torch.no_grad():
            diff = log_ratio(logp=logp.detach(), logp_gen=logp_gen)[mask]
            # k3 estimator of KL(gen || learner): E_gen[exp(d) - 1 - d], d = logp - logp_gen.
            kl = diff.exp() - 1 - diff
            # Built where the scores are and read in one copy: the step's only wait for the device.
            parts = [loss.detach(), entropy[mask].sum(), mask.sum(), kl.sum(), diff.abs().sum(), stats.capped]
            local = torch.stack([t.to(torch.float64) for t in [*parts, stats.tokens, stats.rho_max, -stats.rho_min]])
            local = local.cpu()
            sums = self.dp.sum(local[:7].clone())
            extremes = self.dp.max(local[7:].clone())
        loss_sum, entropy_sum, scored, kl_sum, abs_sum, capped, in_loss_total = sums.tolist()
        some = in_loss_total > 0
        return {
            "loss": loss_sum,
            "policy/entropy": entropy_sum / scored if scored else 0.0,
            "is/mean_abs_logp_diff": abs_sum / scored if scored else 0.0,
            "is/kl_gen_learner": kl_sum / scored if scored else 0.0,
            "is/capped_frac": capped / in_loss_total if some else 0.0,
            "is/rho_max": float(extremes[0]) if some else 1.0,
            "is/rho_min": -float(extremes[1]) if some else 1.0,
        }
