"""Loading a Hugging Face causal LM for training, and scoring with it.

Owns reading any model directory that transformers and vLLM both load
(``AutoModelForCausalLM`` and ``AutoTokenizer``; remote code only when
asked), the check that the checkpoint's tensors and the model's parameters
are the same set (a weight either side lacks is an error that names it,
never a silent skip), parameters a checkpoint stores in other tensors
(transformers' own conversion mapping: a mixture of experts' fused 3-D
expert tensors, stored one tensor per expert as the released models
are), where the model runs and in what precision (``Precision``), the FP32 LM head, and the inference primitives training
needs: per-token log-probs of given completions, and batched sampling with
a KV cache. Knows nothing about losses or optimisers; ``trainer``,
``warmstart`` and ``onpolicy`` build on it. Nothing here names an
architecture: the base model and the head are found through transformers'
own accessors.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from asymptote.codec import safetensors_files
from asymptote.errors import ConfigError, ModelError, PayloadError, WeightsError
from services.learner.attention import is_packed, sequence_lengths
from services.learner.head import HeadPrecision, head_logprobs
from services.learner.routing import ROUTING_KWARG, RouterReplay, RouterReport, RoutingPass

log = logging.getLogger(__name__)

Device = Literal["auto", "cuda", "cpu"]
DType = Literal["auto", "float32", "bfloat16", "float16"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The floating dtypes a policy computes in, or is served in, by name."""

_UNSUPPORTED_HEAD_OPTIONS = ("final_logit_softcapping", "logit_scale")
"""Config fields that change logits after the head's matmul; the FP32 head here does not apply them."""


@dataclass(frozen=True)
class Precision:
    """Where the policy runs, and in what dtype its body computes.

    Parameters, gradients and optimizer state stay float32 (the master
    weights); the transformer body computes in ``compute_dtype``, and the LM
    head's matmul and log-softmax always run in float32 (ScaleRL's FP32
    head), so the log-probs the loss compares are float32 on both sides.
    """

    device: torch.device
    compute_dtype: torch.dtype
    head: HeadPrecision = "fp32"
    """The LM head's operands (``services.learner.head``): float32, or bf16 with float32 accumulation."""

    @classmethod
    def resolve(
        cls,
        device: Device = "auto",
        dtype: DType = "auto",
        local_rank: int | None = None,
        head: Literal["auto", "fp32", "bf16_fp32_acc"] = "auto",
    ) -> Precision:
        """``auto`` device: the GPU numbered ``LOCAL_RANK`` when CUDA is available, else the CPU.
        ``auto`` dtype: bfloat16 on a GPU, float32 on the CPU. ``auto`` head: as a generator's engine
        computing in the same dtype computes it (bf16 operands with float32 accumulation in bf16, float32
        in float32)."""
        rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("device 'cuda': no CUDA device is visible to this process")
            if rank >= torch.cuda.device_count():
                raise ConfigError(
                    f"device 'cuda': LOCAL_RANK {rank} but only {torch.cuda.device_count()} GPUs are visible"
                )
            where = torch.device("cuda", rank)
        else:
            where = torch.device("cpu")
        if dtype == "auto":
            compute = torch.bfloat16 if where.type == "cuda" else torch.float32
        else:
            compute = TORCH_DTYPES[dtype]
        if head == "auto":
            head = "bf16_fp32_acc" if compute == torch.bfloat16 else "fp32"
        return cls(where, compute, head)

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The body's compute dtype for the ops in the block (no-op in float32)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)


CPU_FP32 = Precision(torch.device("cpu"), torch.float32)


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The model directory's tokenizer, padding on the left (batched generation appends after the prompt)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    return tokenizer


def empty_model(model_dir: Path, precision: Precision = CPU_FP32, trust_remote_code: bool = False) -> PreTrainedModel:
    """The causal LM in ``model_dir`` built on the meta device: its modules, nothing allocated.

    Checked against the directory's stored tensors first: ModelError if a
    stored tensor has no parameter to go to, a parameter has no stored
    tensor (a tied LM head aside), a shape differs, or the head applies a
    transform the FP32 head does not. ``materialize`` then allocates it
    where it will live (each rank its own shards, after ``sharding.shard``)
    and ``fill_from_dir`` reads the weights into it.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(
            config,
            dtype=torch.float32,
            # Eager attention on the CPU is exact and fastest at small sizes; SDPA on GPUs.
            attn_implementation="sdpa" if precision.device.type == "cuda" else "eager",
            trust_remote_code=trust_remote_code,
        )
    _check_fits(model, model_dir)
    for option in _UNSUPPORTED_HEAD_OPTIONS:
        if getattr(model.config, option, None) not in (None, 0, 0.0, 1, 1.0):
            raise ModelError(
                f"{model_dir}: {type(model).__name__} sets {option}, which the FP32 LM head does not apply"
            )
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        raise ModelError(f"{model_dir}: {type(model).__name__} has no linear LM head to run in float32")
    return model


def load_model(model_dir: Path, precision: Precision = CPU_FP32, trust_remote_code: bool = False) -> PreTrainedModel:
    """The causal LM in ``model_dir`` with float32 parameters on ``precision.device`` (one process, whole).

    Built on the meta device and filled one stored tensor at a time, so the
    host holds the float32 model and one tensor beside it; ModelError as
    ``empty_model`` says.
    """
    model = empty_model(model_dir, precision, trust_remote_code)
    materialize(model, precision.device)
    fill_from_dir(model, Path(model_dir))
    return model


def aliases(model: torch.nn.Module) -> dict[str, str]:
    """State-dict names that are another name's tensor (a tied LM head): alias -> the first name."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def _stored_tensors(model_dir: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Each stored tensor's file and shape, from the safetensors headers (nothing read)."""
    from safetensors import safe_open

    stored: dict[str, tuple[Path, tuple[int, ...]]] = {}
    try:
        files = safetensors_files(model_dir)
    except WeightsError as exc:
        raise ModelError(str(exc)) from exc
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                stored[name] = (path, tuple(int(d) for d in f.get_slice(name).get_shape()))
    return stored


def _check_fits(model: PreTrainedModel, model_dir: Path) -> None:
    """ModelError naming every parameter or buffer the stored tensors lack, every stored tensor the model
    does not take, and every shape that differs (the names transformers itself ignores aside).

    A parameter stored in other tensors (``stored_parts``) is checked as those tensors."""
    stored = _stored_tensors(model_dir)
    tied = aliases(model)
    wanted: dict[str, tuple[int, ...]] = {}
    for k, v in model.state_dict().items():
        if k not in tied:
            wanted |= stored_parts(model, k, tuple(v.shape))
    ignored_missing = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ()]
    ignored_extra = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    ignored_extra.append(re.compile(r"rotary_emb\.inv_freq"))  # a buffer older checkpoints stored
    missing = [k for k in wanted if k not in stored and not any(p.search(k) for p in ignored_missing)]
    extra = [k for k in stored if k not in wanted and k not in tied and not any(p.search(k) for p in ignored_extra)]
    mismatched = [(k, stored[k][1], wanted[k]) for k in wanted if k in stored and stored[k][1] != wanted[k]]
    problems = []
    for keys, what in (
        (missing, "model weights the checkpoint lacks"),
        (extra, "checkpoint weights the model does not take"),
        (mismatched, "weights whose shapes differ"),
    ):
        names = sorted(_describe(k) for k in keys)
        if names:
            problems.append(f"{len(names)} {what}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
    if problems:
        raise ModelError(f"{model_dir} does not fit {type(model).__name__}: {'; '.join(problems)}")


def stored_parts(model: torch.nn.Module, name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The stored tensors that hold state-dict entry ``name`` of ``shape``, with their shapes.

    ``{name: shape}`` for most; for a parameter transformers converts on
    loading (its checkpoint conversion mapping, e.g. a mixture of experts'
    ``mlp.experts.gate_up_proj`` [experts, 2 x width, hidden], stored as
    each expert's ``gate_proj`` and ``up_proj``), the tensors it is saved as.
    """
    if not isinstance(model, PreTrainedModel):
        return {name: shape}
    from transformers.core_model_loading import revert_weight_conversion

    parts = revert_weight_conversion(model, {name: torch.empty(shape, device="meta")})
    return {k: tuple(v.shape) for k, v in parts.items()}


def _assemble(
    model: PreTrainedModel, name: str, shape: tuple[int, ...], read: dict[str, torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """State-dict entry ``name`` built from its stored parts ``read`` (``stored_parts``), in ``dtype``.

    Loading's conversions only move elements (stack, concatenate,
    transpose), so saving an index tensor through transformers' own reverse
    conversion tells where each stored element goes.
    """
    from transformers.core_model_loading import revert_weight_conversion

    numel = math.prod(shape)
    index = torch.arange(numel, dtype=torch.int32 if numel < 2**31 else torch.int64).view(shape)
    whole = torch.empty(numel, dtype=dtype)
    for part, where in revert_weight_conversion(model, {name: index}).items():
        whole[where.reshape(-1).long()] = read[part].reshape(-1).to(dtype)
    return whole.view(shape)


def materialize(model: PreTrainedModel, device: torch.device) -> None:
    """Allocate a model built on the meta device on ``device``, uninitialised, its ties and computed buffers kept.

    Under FSDP2 (``sharding.shard`` first) each rank allocates only its own
    shards. Buffers that no checkpoint holds (the rotary embedding's
    frequencies) are computed as the model's constructor computes them.
    A model already allocated is left as it is.
    """
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    tied = aliases(model)
    model.to_empty(device=device)
    for alias, name in tied.items():  # to_empty gives each module a tensor of its own
        owner, _, leaf = alias.rpartition(".")
        first = model.get_parameter(name)
        if model.get_submodule(owner)._parameters.get(leaf) is not first:
            setattr(model.get_submodule(owner), leaf, first)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "_non_persistent_buffers_set", None):
                model._init_weights(module)


def fill_from_dir(model: torch.nn.Module, model_dir: Path) -> None:
    """Read the stored tensors of ``model_dir`` into ``model``'s parameters and buffers, one at a time.

    A sharded parameter (FSDP2's DTensor) gets only this rank's rows, read
    as a slice of the stored tensor, so no rank ever holds a whole tensor it
    does not own; the stored dtype is converted to the parameter's. A
    parameter stored in other tensors (``stored_parts``: an MoE layer's
    experts) is assembled whole on the host from them first, then its rows
    are copied.
    """
    from safetensors import safe_open

    stored = _stored_tensors(model_dir)
    tied = aliases(model)
    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    converted: list[tuple[str, dict[str, tuple[int, ...]], torch.Tensor]] = []
    for name, target in model.state_dict().items():
        if name in tied:
            continue
        name = stored_name(name)
        parts = stored_parts(model, name, tuple(target.shape))
        if name not in parts:
            converted.append((name, parts, target))
        elif name in stored:
            by_file.setdefault(stored[name][0], []).append((name, target))
        # else: a name transformers ignores (checked by empty_model), or a LoRA adapter's
    with torch.no_grad():
        for path, targets in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name, target in targets:
                    _copy_into(target, functools.partial(_read_stored, f, name))
        for name, parts, target in converted:
            read: dict[str, torch.Tensor] = {}
            for part in parts:
                with safe_open(str(stored[part][0]), framework="pt") as f:
                    read[part] = f.get_tensor(part)
            assert isinstance(model, PreTrainedModel), "only a transformers model converts its stored tensors"
            whole = _assemble(model, name, tuple(target.shape), read, target.dtype)
            _copy_into(target, functools.partial(_rows_of, whole))


def _read_stored(file: Any, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
    """Stored tensor ``name`` of an open safetensors file: whole (``index`` None) or those rows."""
    out: torch.Tensor = file.get_tensor(name) if index is None else file.get_slice(name)[index]
    return out


def _rows_of(whole: torch.Tensor, index: tuple[slice, ...] | None) -> torch.Tensor:
    """``whole``, or its rows ``index``."""
    return whole if index is None else whole[index]


def _copy_into(target: torch.Tensor, source: Callable[[tuple[slice, ...] | None], torch.Tensor]) -> None:
    """Copy into ``target`` what ``source`` reads: the whole tensor (``None``), or a sharded parameter's own
    rows (FSDP2's DTensor; the index of its shard)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(target, DTensor):
        local = target.to_local()
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        if local.numel():
            local.copy_(source(tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))))
    else:
        target.copy_(source(None))


def stored_name(name: str) -> str:
    """The stored tensor a parameter reads: its own name, or for a layer a LoRA adapter wraps (peft's
    ``base_layer``) the wrapped layer's."""
    return name.replace(".base_layer.", ".")


def _describe(key: object) -> str:
    """A loading-info entry: a name, or (name, checkpoint shape, model shape) for a mismatch."""
    if isinstance(key, tuple) and len(key) == 3:
        name, ckpt, want = key
        return f"{name} (checkpoint {list(ckpt)}, model {list(want)})"
    return str(key)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class PackedBatch:
    """Prompts left-padded to a common length L, completions right-padded to T.

    Row n is ``[pad.. prompt_n completion_n pad..]``; with ``position_ids``
    counting from the first real token, each row sees exactly what an
    unpadded run (vLLM) sees.
    """

    input_ids: torch.Tensor
    """[N, L + T] token ids."""
    attention_mask: torch.Tensor
    """[N, L + T] 1 on real tokens."""
    position_ids: torch.Tensor
    """[N, L + T] position of each token in its own unpadded sequence."""
    prompt_len: int
    """L, the padded prompt length."""
    completion_mask: torch.Tensor
    """[N, T] 1 on real completion tokens."""
    routing: torch.Tensor | None = None
    """[N, L + T, MoE layers, k] the experts the generator routed each token to in each MoE layer (logical
    ids, in the dtype they came in; 0 where none was recorded), laid out as ``input_ids``; None: none sent."""
    routed: torch.Tensor | None = None
    """[N, L + T] True where a token has recorded routing (with ``routing``)."""

    def to(self, device: torch.device) -> PackedBatch:
        """The same batch on ``device`` (itself when it is there already)."""
        if self.input_ids.device == device:
            return self
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            completion_mask=self.completion_mask.to(device),
            routing=None if self.routing is None else self.routing.to(device),
            routed=None if self.routed is None else self.routed.to(device),
        )


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


def pack(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    routing: Sequence[torch.Tensor] | None = None,
) -> PackedBatch:
    """Lay out prompt and completion token ids for one forward pass (see PackedBatch).

    ``routing``: each row's recorded experts, [tokens, MoE layers, k] over
    its prompt and completion tokens in order, as the generator records
    them (all but the last completion token, which no forward has seen, or
    all of them); one integer dtype and shape for every row. PayloadError
    for a row that does not fit.
    """
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"need as many prompts as completions (>0), got {len(prompts)} and {len(completions)}")
    prompt_ids, prompt_mask = _left_pad(prompts, pad_id)
    width = max(1, max(len(c) for c in completions))
    comp_ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    comp_mask = torch.zeros((len(completions), width), dtype=torch.long)
    for i, c in enumerate(completions):
        comp_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        comp_mask[i, : len(c)] = 1
    mask = torch.cat([prompt_mask, comp_mask], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp_min(0)
    laid_out, routed = (None, None) if routing is None else _lay_out_routing(prompts, completions, routing, width)
    return PackedBatch(
        input_ids=torch.cat([prompt_ids, comp_ids], dim=1),
        attention_mask=mask,
        position_ids=positions,
        prompt_len=prompt_ids.shape[1],
        completion_mask=comp_mask,
        routing=laid_out,
        routed=routed,
    )


def _lay_out_routing(
    prompts: list[list[int]], completions: list[list[int]], routing: Sequence[torch.Tensor], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's routing at its tokens' columns of the packed layout, and where it was recorded."""
    if len(routing) != len(prompts):
        raise PayloadError(f"routing for {len(routing)} rows, the batch has {len(prompts)}")
    first = routing[0]
    prompt_len = max(len(p) for p in prompts)
    out = torch.zeros((len(prompts), prompt_len + width, *first.shape[1:]), dtype=first.dtype)
    routed = torch.zeros((len(prompts), prompt_len + width), dtype=torch.bool)
    for n, (prompt, completion, rows) in enumerate(zip(prompts, completions, routing, strict=True)):
        tokens = len(prompt) + len(completion)
        if rows.dim() != 3 or rows.shape[1:] != first.shape[1:] or rows.dtype != first.dtype:
            raise PayloadError(
                f"row {n}'s routing is {list(rows.shape)} {rows.dtype}, row 0's {list(first.shape)} {first.dtype}: "
                "every row takes [tokens, MoE layers, k] in one dtype"
            )
        if rows.shape[0] not in (tokens - 1, tokens):
            raise PayloadError(
                f"row {n}'s routing covers {rows.shape[0]} tokens, its prompt and completion are {tokens} "
                f"({len(prompt)} + {len(completion)}): it takes {tokens - 1} (all but the last) or {tokens}"
            )
        start = prompt_len - len(prompt)
        out[n, start : start + rows.shape[0]] = rows
        routed[n, start : start + rows.shape[0]] = True
    return out, routed


class PolicyForward(torch.nn.Module):
    """Per-token log-probs and entropies of completions, as the module data parallelism wraps.

    ``forward(batch, temperature)`` returns two [N, T] tensors: the log-prob
    of each completion token under the distribution the generator sampled
    from (logits divided by each row's temperature, log-softmax in float32)
    and that distribution's entropy (no gradient), 0 on padding. The body
    runs in ``precision``'s compute dtype; only the real completion tokens go
    through the head, in ``precision.head`` (services.learner.head).

    ``replay``: an MoE model's routers (``routing.RouterReplay``): a batch's
    ``routing`` is replayed in them, and ``report`` (a ``RouterReport``)
    gets what they report for the forward.
    """

    def __init__(
        self, model: PreTrainedModel, precision: Precision = CPU_FP32, replay: RouterReplay | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self.precision = precision
        self.replay = replay

    def forward(
        self, batch: PackedBatch, temperature: torch.Tensor, report: RouterReport | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, batch = self._body(batch, report)
        real = batch.completion_mask.bool()
        targets = batch.input_ids[:, batch.prompt_len :][real]
        inv_temperature = (1.0 / temperature.to(hidden.device, torch.float32))[:, None].expand(real.shape)[real]
        head = self.model.get_output_embeddings()
        logp_real, entropy_real = head_logprobs(
            hidden, head.weight, head.bias, targets, inv_temperature, self.precision.head
        )
        logp = torch.zeros(real.shape, dtype=logp_real.dtype, device=hidden.device).masked_scatter(real, logp_real)
        entropy = torch.zeros_like(logp).masked_scatter(real, entropy_real.detach())
        return logp, entropy

    def _body(self, batch: PackedBatch, report: RouterReport | None) -> tuple[torch.Tensor, PackedBatch]:
        """The body's last hidden state before each real completion token, in row order, and the batch
        where the model is.

        Logits at position L-1+t of a padded row predict completion token t.
        A packed model (``attention.use_packed_attention``) gets the rows'
        real tokens end to end as one row, each sequence attending only to
        itself; otherwise the padded rows go through as they are. Routing
        goes to the routers in the same token order.
        """
        device = self.precision.device
        if not is_packed(self.model):
            batch = batch.to(device)
            tokens = None
            routers = self._routers(batch, None, report)
            with self.precision.autocast():
                out = self.model.base_model(
                    input_ids=batch.input_ids,
                    attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids,
                    use_cache=False,  # a KV cache is for sampling; checkpointed layers would fill it twice
                    **routers,
                )
            real = batch.completion_mask.bool()
            self._report(batch, tokens, routers, out, report)
            return out.last_hidden_state[:, batch.prompt_len - 1 : -1][real], batch
        # Laid out on the host, where the batch arrives: no device sync for the sequences' lengths.
        tokens = batch.attention_mask.bool()
        at = tokens.flatten().cumsum(0).view(tokens.shape) - 1  # each real token's place in the packed row
        source = at[:, batch.prompt_len - 1 : -1][batch.completion_mask.bool()]
        lengths = sequence_lengths(tokens.sum(1), device)
        ids, positions = batch.input_ids[tokens][None].to(device), batch.position_ids[tokens][None].to(device)
        routers = self._routers(batch, tokens, report)
        with self.precision.autocast():
            out = self.model.base_model(input_ids=ids, position_ids=positions, use_cache=False, **lengths, **routers)
        self._report(batch, tokens, routers, out, report)
        return out.last_hidden_state[0][source.to(device)], batch.to(device)

    def _routers(self, batch: PackedBatch, tokens: torch.Tensor | None, report: RouterReport | None) -> dict[str, Any]:
        """The forward's keywords for an MoE model's routers: the routing pass, in the order the routers see
        the tokens (``tokens``: the real ones of a packed row; None: every position of the padded rows)."""
        if self.replay is None:
            return {}
        experts = recorded = None
        if batch.routing is not None and batch.routed is not None:
            if tokens is None:
                experts, recorded = batch.routing.flatten(0, 1), batch.routed.flatten()
            else:
                experts, recorded = batch.routing[tokens], batch.routed[tokens]
            experts, recorded = experts.to(self.precision.device), recorded.to(self.precision.device)
        keep_own = report is not None and report.keep_own
        kwargs: dict[str, Any] = {ROUTING_KWARG: RoutingPass(experts, recorded, keep_own=keep_own)}
        if report is not None and report.load_balancing:
            kwargs["output_router_logits"] = True
        return kwargs

    def _report(
        self,
        batch: PackedBatch,
        tokens: torch.Tensor | None,
        routers: dict[str, Any],
        out: Any,
        report: RouterReport | None,
    ) -> None:
        """Fill ``report`` from the routing pass the forward's routers wrote into."""
        if report is None or self.replay is None:
            return
        routing: RoutingPass = routers[ROUTING_KWARG]
        layers = len(self.replay.layout.moe_layers)
        if routing.keep_own:
            own = torch.stack([routing.own[m] for m in range(layers)], dim=1)  # [tokens seen, layers, k]
            if tokens is None:
                report.own = own.view(*batch.input_ids.shape, *own.shape[1:])
            else:
                report.own = own.new_zeros((*tokens.shape, *own.shape[1:]))
                report.own[tokens.to(own.device)] = own
        if routing.recorded is not None:
            report.decisions = routing.recorded.sum() * layers
            report.differing = torch.stack([routing.differing[m] for m in range(layers)]).sum()
        if report.load_balancing:
            report.load_balancing_loss = self.replay.load_balancing_loss(
                out.router_logits, None if tokens is not None else batch.attention_mask
            )


def completion_logprobs(
    model: PreTrainedModel, batch: PackedBatch, temperature: float = 1.0, precision: Precision = CPU_FP32
) -> torch.Tensor:
    """[N, T] log-prob of each completion token under ``model`` (0 where masked), on the CPU.

    The sampling distribution's (logits divided by ``temperature``), with
    the FP32 head. Differentiable; call under no_grad for scoring.
    """
    temps = torch.full((batch.input_ids.shape[0],), float(temperature))
    logp, _ = PolicyForward(model, precision)(batch, temps)
    return logp.cpu() * batch.completion_mask


@dataclass(frozen=True)
class Samples:
    """Completions sampled from a batch of prompts."""

    completions: list[list[int]]
    """Token ids of each completion, ending with EOS (or a stop token) unless truncated."""
    logprobs: list[list[float]]
    """Sampling log-prob of each completion token (at the sampling temperature)."""
    truncated: list[bool]
    """True where the row's max_new_tokens ran out before EOS (or a stop token)."""


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int | Sequence[int],
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    stop_ids: Collection[int] = (),
) -> Samples:
    """Sample one completion per prompt row (repeat rows for a group), KV-cached.

    Full-vocabulary sampling (no top-k/top-p), as the RL recipe assumes.
    ``max_new_tokens``: one limit for every row, or one per row. A row ends
    at EOS, at a token of ``stop_ids`` (kept, as vLLM keeps a stop string
    with ``include_stop_str_in_output``) or at its limit (truncated).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    n = len(prompts)
    limits = torch.tensor([max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens))
    if limits.numel() != n or bool((limits < 1).any()):
        raise ValueError(f"max_new_tokens must be >= 1, one for all rows or one per row ({n}), got {max_new_tokens}")
    ends = torch.tensor(sorted({eos_id, *stop_ids}), dtype=torch.long)
    ids, mask = _left_pad(prompts, pad_id)
    positions = (mask.cumsum(dim=1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache = out.past_key_values
    logits = out.logits[:, -1].float()
    next_pos = positions[:, -1:] + 1
    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    alive = torch.ones(n, dtype=torch.bool)
    ended = torch.zeros(n, dtype=torch.bool)
    lengths = torch.zeros(n, dtype=torch.long)
    for _ in range(int(limits.max())):
        logp_all = torch.log_softmax(logits / temperature, dim=-1)
        tok = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(1)
        tokens.append(tok)
        logps.append(logp_all.gather(1, tok[:, None]).squeeze(1))
        lengths += alive.long()
        ended |= alive & torch.isin(tok, ends)
        alive = ~ended & (lengths < limits)
        if not alive.any():
            break
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype)], dim=1)
        out = model(
            input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, past_key_values=cache, use_cache=True
        )
        cache = out.past_key_values
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    tok_mat = torch.stack(tokens, dim=1).tolist()
    logp_mat = torch.stack(logps, dim=1).tolist()
    lens = lengths.tolist()
    return Samples(
        completions=[row[:k] for row, k in zip(tok_mat, lens)],
        logprobs=[row[:k] for row, k in zip(logp_mat, lens)],
        truncated=[not e for e in ended.tolist()],
    )
