"""A mixture of experts' routing as it travels in a rollout group (rollout routing replay, R3).

Owns the wire form of the experts a generator's MoE layers routed each
token to (rollout.proto's ``RoutingLayout`` and the ``routing`` /
``prompt_routing`` bytes): ids in the smallest dtype that holds them, only
the MoE layers' columns, the prompt's rows once per group and each
completion's own rows; the bytes that costs a token; the checks a
group's routing must pass (shape against its tokens, a known dtype, ids
below the experts); and turning a group back into one ``[tokens, MoE
layers, k]`` array per completion, prompt rows first, as the learner lays
them out. Torch-free (numpy): the broker validates routing without a model.
Whether the routing fits a model (its MoE layers, top-k and experts) is
the learner's check.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import PayloadError

DTYPES: dict[rollout_pb2.RoutingDtype, np.dtype] = {
    rollout_pb2.ROUTING_DTYPE_UINT8: np.dtype("<u1"),
    rollout_pb2.ROUTING_DTYPE_UINT16: np.dtype("<u2"),
}
"""RoutingDtype -> the little-endian numpy dtype of its ids."""


def routing_dtype(num_experts: int) -> rollout_pb2.RoutingDtype:
    """The smallest RoutingDtype whose ids name each of ``num_experts`` experts; ValueError past uint16."""
    for code, dtype in DTYPES.items():
        if num_experts - 1 <= np.iinfo(dtype).max:
            return code
    raise ValueError(f"{num_experts} experts: more than {np.iinfo(np.uint16).max + 1} do not fit any routing dtype")


def layout(num_moe_layers: int, top_k: int, num_experts: int) -> rollout_pb2.RoutingLayout:
    """The RoutingLayout of a model's MoE layers, ids in their smallest dtype."""
    return rollout_pb2.RoutingLayout(
        num_moe_layers=num_moe_layers, top_k=top_k, num_experts=num_experts, dtype=routing_dtype(num_experts)
    )


def model_layout(config: dict[str, object]) -> rollout_pb2.RoutingLayout | None:
    """The routing layout of a model by its ``config.json`` (None: no routed experts), as Qwen-MoE and Mixtral
    configs say it: ``num_experts`` (or ``num_local_experts``), ``num_experts_per_tok``, and for Qwen-MoE the
    dense layers (``mlp_only_layers``, and every layer but each ``decoder_sparse_step``-th)."""
    experts = config.get("num_experts") or config.get("num_local_experts")
    top_k = config.get("num_experts_per_tok")
    layers = config.get("num_hidden_layers")
    if not (isinstance(experts, int) and isinstance(top_k, int) and isinstance(layers, int)) or experts < 2:
        return None
    moe = moe_layers(config)
    return layout(len(moe), top_k, experts) if moe else None


def moe_layers(config: dict[str, object]) -> list[int]:
    """The decoder layers of a Qwen-MoE or Mixtral ``config.json`` that route to experts, in order."""
    layers = config.get("num_hidden_layers")
    dense = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step") or 1
    assert isinstance(layers, int) and isinstance(dense, list) and isinstance(step, int)
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def bytes_per_token(spec: rollout_pb2.RoutingLayout) -> int:
    """Routing bytes one token's row takes on the wire."""
    return int(spec.num_moe_layers * spec.top_k * DTYPES[spec.dtype].itemsize)


def encode_rows(rows: np.ndarray, spec: rollout_pb2.RoutingLayout) -> bytes:
    """``rows`` [tokens, MoE layers, k] of expert ids as ``spec``'s bytes (ValueError for another shape or an id
    that does not fit)."""
    width = (spec.num_moe_layers, spec.top_k)
    if rows.ndim != 3 or tuple(rows.shape[1:]) != width:
        raise ValueError(f"routing rows of shape {list(rows.shape)}, the layout takes [tokens, {width[0]}, {width[1]}]")
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= spec.num_experts):
        raise ValueError(f"routing rows name experts {int(rows.min())}-{int(rows.max())} of {spec.num_experts}")
    return np.ascontiguousarray(rows, dtype=DTYPES[spec.dtype]).tobytes()


def _rows(data: bytes, spec: rollout_pb2.RoutingLayout, tokens: tuple[int, ...], where: str) -> np.ndarray:
    """``data`` as [tokens, layers, k] ids: PayloadError unless it holds one of ``tokens`` rows, ids in range."""
    dtype = DTYPES[spec.dtype]
    row_bytes = bytes_per_token(spec)
    if len(data) % row_bytes or len(data) // row_bytes not in tokens:
        accepted = " or ".join(str(n) for n in tokens)
        raise PayloadError(
            f"{where}: {len(data)} routing bytes, not {accepted} rows of {spec.num_moe_layers} MoE layers x "
            f"top-{spec.top_k} in {dtype.name} ({row_bytes} bytes a token)"
        )
    rows = np.frombuffer(data, dtype=dtype).reshape(-1, spec.num_moe_layers, spec.top_k)
    if rows.size and int(rows.max()) >= spec.num_experts:
        raise PayloadError(
            f"{where}: routing names expert {int(rows.max())} of {spec.num_experts} (ids 0-{spec.num_experts - 1})"
        )
    return rows


def check_layout(group: rollout_pb2.RolloutGroup) -> rollout_pb2.RoutingLayout | None:
    """The group's routing layout, None without one; PayloadError (naming the group) for a layout no routing
    can have, or routing bytes without a layout."""
    if not group.HasField("routing"):
        if group.prompt_routing or any(c.routing or c.prompt_routing for c in group.completions):
            raise PayloadError(f"group {group.group_id}: routing rows without a routing layout")
        return None
    spec = group.routing
    if spec.dtype not in DTYPES:
        raise PayloadError(f"group {group.group_id}: unknown routing dtype {spec.dtype} (accepted: uint8, uint16)")
    if not (spec.num_moe_layers and spec.top_k and spec.top_k <= spec.num_experts):
        raise PayloadError(
            f"group {group.group_id}: routing layout of {spec.num_moe_layers} MoE layers, top-{spec.top_k} of "
            f"{spec.num_experts} experts"
        )
    if np.iinfo(DTYPES[spec.dtype]).max < spec.num_experts - 1:
        raise PayloadError(
            f"group {group.group_id}: routing in {DTYPES[spec.dtype].name} cannot name {spec.num_experts} experts"
        )
    return spec


def attach(group: rollout_pb2.RolloutGroup, rows: list[bytes], spec: rollout_pb2.RoutingLayout, max_bytes: int) -> None:
    """Put each completion's ``rows`` (its prompt's then its own tokens', ``spec``'s bytes, one per completion
    in order, all sharing the group's prompt) into ``group``: the prompt's rows once, each completion's own.

    PayloadError naming the group, before anything is added, when the group with its routing would be over
    ``max_bytes`` (what the rollouts stream admits): never truncated.
    """
    row_bytes = bytes_per_token(spec)
    prompt = len(group.prompt_token_ids) * row_bytes
    own = [r[prompt:] for r in rows]
    framing = 6 * (len(own) + 1) + spec.ByteSize() + 2  # a key and a length for each bytes field
    total = group.ByteSize() + prompt + sum(map(len, own)) + framing
    if total > max_bytes:
        raise PayloadError(
            f"group {group.group_id} with its routing is {total} bytes ({prompt + sum(map(len, own))} of routing, "
            f"{row_bytes} a token), over the {max_bytes} a rollout group may take: lower sampling.max_tokens or "
            "sampling.group_size"
        )
    group.routing.CopyFrom(spec)
    group.prompt_routing = rows[0][:prompt]
    for c, r in zip(group.completions, own, strict=True):
        c.routing = r


def check_rows(group: rollout_pb2.RolloutGroup) -> None:
    """PayloadError naming the group (and completion) for routing that does not fit its tokens (``decode_rows``)."""
    for _ in _walk(group):
        pass


def decode_rows(group: rollout_pb2.RolloutGroup) -> list[np.ndarray] | None:
    """Each completion's routing, its prompt's rows then its own, [prompt + completion (- 1), MoE layers, k];
    None for a group without routing. PayloadError naming the group and completion for rows that do not fit
    their tokens or name an expert past the layout's."""
    if check_layout(group) is None:
        return None
    return [np.concatenate([prompt, own]) for prompt, own in _walk(group)]


def _walk(group: rollout_pb2.RolloutGroup) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each completion's (prompt rows, own rows), checked; nothing for a group without routing."""
    spec = check_layout(group)
    if spec is None:
        return
    gid = group.group_id
    shared = None
    if group.prompt_token_ids:
        shared = _rows(group.prompt_routing, spec, (len(group.prompt_token_ids),), f"group {gid} prompt")
    elif group.prompt_routing:
        raise PayloadError(f"group {gid}: prompt routing without prompt tokens")
    for i, c in enumerate(group.completions):
        where = f"group {gid} completion {i}"
        if c.prompt_token_ids:
            prompt = _rows(c.prompt_routing, spec, (len(c.prompt_token_ids),), f"{where} prompt")
        elif c.prompt_routing:
            raise PayloadError(f"{where}: prompt routing without prompt tokens of its own")
        else:
            assert shared is not None, "validate_group: a completion without its own prompt has the group's"
            prompt = shared
        n = len(c.token_ids)
        yield prompt, _rows(c.routing, spec, (n - 1, n), where)
