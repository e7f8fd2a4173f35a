"""The experts a CPU engine's MoE layers route each token to, recorded per request (runs inside vLLM's worker).

Owns the generator's own routing capture for rollout routing replay where
vLLM's (``enable_return_routed_experts``, Model Runner V2) cannot run, as
on the CPU build. Every MoE layer's router (a ``BaseRouter``) calls a
capture function with the top-k ids of one forward's tokens, flattened
in the model runner's batch order. The last MoE layer's call of a forward
lays the forward's rows out by request: the runner's input batch names
the requests in order, its query start offsets split the tokens among
them, and its positions say where each token sits in its sequence.

Prompt tokens served from the prefix cache are never recomputed, so no
router sees them again. Their rows are kept with the KV they produced:
every computed token's row is also written at its KV slot (physical
block x offset) in a table the size of the KV cache, so a request that
starts on cached blocks reads the rows of exactly the blocks it reuses,
whatever request, salt or policy version computed them. That is sound
because a block's rows are written when, and only when, its KV is: a
block freed and given to other tokens is overwritten by their forward
before any request can hit it. Rows before and after an in-flight swap
come from the weights that computed them, as their KV does (nothing is
recomputed).

A request's rows are taken once it has finished (``take``); rows of
requests never taken (aborted) are dropped oldest first beyond a bound.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import numpy as np

CHILD_ID = re.compile(r"^(?:(\d+)_)?([0-9a-f]+)(?:-[0-9A-Za-z]+)?$")
"""A worker's request id: ``[index_]request[-suffix]`` (vLLM's parallel-sampling child index, the id the
driver gave, the suffix the engine appends)."""


class RoutingCapture:
    """Records an MoE model's routing in a worker: ``install`` it on the model runner, then ``take`` each
    request's rows by the id the driver gave."""

    def __init__(self, runner: Any) -> None:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self.runner = runner
        layers = sorted((m.layer_id, m) for m in runner.get_model().modules() if isinstance(m, MoERunner))
        if not layers:
            raise RuntimeError(f"routing capture: {type(runner.get_model()).__name__} has no MoE layers")
        for layer_id, module in layers:
            if not isinstance(module.router, BaseRouter):
                raise RuntimeError(
                    f"routing capture: layer {layer_id}'s router {type(module.router).__name__} is not a BaseRouter"
                )
        groups = runner.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise RuntimeError(f"routing capture needs one KV cache group, the model has {len(groups)}")
        self.moe_layers = [layer_id for layer_id, _ in layers]
        """The decoder layer of each MoE layer, in order: column m of a row."""
        router: Any = layers[0][1].router
        self.top_k = int(router.top_k)
        self.num_experts = int(router.global_num_experts)
        self.dtype = np.uint8 if self.num_experts <= 256 else np.uint16
        self.block_size = int(groups[0].kv_cache_spec.block_size)
        width = (len(self.moe_layers), self.top_k)
        self._step = np.zeros((runner.max_num_tokens, *width), dtype=self.dtype)
        """The forward in flight's rows, in its token order, filled layer by layer."""
        self._slots = np.zeros((runner.kv_cache_config.num_blocks * self.block_size, *width), dtype=self.dtype)
        """The rows of the tokens whose KV each cache slot holds."""
        self._rows: OrderedDict[str, np.ndarray] = OrderedDict()
        """Request id -> its rows by position so far (capacity doubling)."""
        self._lengths: dict[str, int] = {}
        self.max_requests = 4 * int(runner.max_num_reqs)
        for column, (_, module) in enumerate(layers):
            module.router.set_capture_fn(self._capture_fn(column))

    def _capture_fn(self, column: int) -> Any:
        last = column == len(self.moe_layers) - 1

        def capture(topk_ids: Any) -> None:
            n = topk_ids.shape[0]
            self._step[:n, column] = topk_ids.cpu().numpy()
            if last:
                self._lay_out()

        return capture

    def _lay_out(self) -> None:
        """The forward's rows to their requests and KV slots (the last MoE layer has routed)."""
        runner = self.runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        starts = runner.query_start_loc.cpu[: num_reqs + 1].numpy()
        positions = runner.positions[: int(starts[-1])].cpu().numpy()
        for r, req_id in enumerate(batch.req_ids[:num_reqs]):
            begin, end = int(starts[r]), int(starts[r + 1])
            if end == begin:
                continue
            pos = positions[begin:end]
            blocks = np.asarray(runner.requests[req_id].block_ids[0], dtype=np.int64)
            rows = self._rows.get(req_id)
            if rows is None:
                rows = self._start(req_id, int(pos[0]), blocks)
            if int(pos[-1]) >= len(rows):
                grown = np.zeros((max(2 * len(rows), int(pos[-1]) + 1), *rows.shape[1:]), dtype=self.dtype)
                grown[: len(rows)] = rows
                rows = self._rows[req_id] = grown
            rows[pos] = self._step[begin:end]
            self._lengths[req_id] = max(self._lengths[req_id], int(pos[-1]) + 1)
            self._slots[blocks[pos // self.block_size] * self.block_size + pos % self.block_size] = self._step[
                begin:end
            ]

    def _start(self, req_id: str, first: int, blocks: np.ndarray) -> np.ndarray:
        """A request's rows, the first time a forward holds it: the rows of the prefix-cached tokens before
        ``first`` are those its reused KV blocks were computed with."""
        rows = np.zeros((max(2 * first, 64), len(self.moe_layers), self.top_k), dtype=self.dtype)
        if first:
            cached = np.arange(first)
            rows[:first] = self._slots[blocks[cached // self.block_size] * self.block_size + cached % self.block_size]
        self._rows[req_id] = rows
        self._lengths[req_id] = first
        while len(self._rows) > self.max_requests:  # requests never taken (aborted): oldest first
            old, _ = self._rows.popitem(last=False)
            self._lengths.pop(old, None)
        return rows

    def take(self, request_id: str) -> dict[int, bytes]:
        """The rows of every request the driver submitted as ``request_id`` (its parallel samples by index),
        [positions, MoE layers, k] row-major bytes in ``dtype``; each is forgotten here."""
        out: dict[int, bytes] = {}
        for req_id in list(self._rows):
            parsed = _driver_id(req_id)
            if parsed is not None and parsed[1] == request_id:
                rows = self._rows.pop(req_id)
                out[parsed[0]] = rows[: self._lengths.pop(req_id)].tobytes()
        return out


def _driver_id(req_id: str) -> tuple[int, str] | None:
    """(sample index, the driver's request id) of a worker's request id; None for another form."""
    match = CHILD_ID.match(req_id)
    if match is None:
        return None
    return int(match.group(1) or 0), match.group(2)
