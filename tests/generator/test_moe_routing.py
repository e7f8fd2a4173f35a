"""The experts a CPU engine routed each token to, as the generator records them for routing replay.

The tiny Qwen3-MoE (3 layers, the first dense, top-2 of 8 experts) in
vLLM's CPU build with a float32 engine, which the generator's own capture
serves (services.generator.capture; vLLM's needs Model Runner V2). One
engine for the module. Each sample's routing has one row per prompt and
completion token but the last, 2 MoE layers x top-2 in uint8, and equals
the top-k of a transformers forward on the same tokens, wherever the
router's k-th and next logits are not a near tie; a second request for a
prompt longer than a KV block reuses the cached block and still gets its
rows (the rows its KV was computed with); and across a swap mid-sequence
the rows before the switch are version 0's and those after it, in every
MoE layer, version 1's over version 0's KV, as the engine computed them.
Each layer's routing after the swap depends on the experts of the MoE
layers below it, and the log-probs after it on every layer's, so the swap
of the experts' packed weights is checked here too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from asymptote.codec import DecodedWeights, read_signature, version_digest
from asymptote.contracts.v1 import rollout_pb2
from asymptote.sample import Sample
from services.embedded.build import create_test_model_dir
from services.generator.config import EngineSettings
from services.generator.engine import Engine
from services.generator.weights import stage
from services.learner.model import load_model, load_tokenizer
from services.learner.weights import stored_tensors, to_wire

pytestmark = [pytest.mark.vllm]

MOE_LAYERS, TOP_K = 2, 2
TIE = 1e-4
"""A router's k-th and (k+1)-th logits closer than this may order either way between two float32 kernels."""
LOGPROB_ATOL = 1e-3
"""A sampled token's log-prob in the float32 engine against transformers' (their kernels sum in different orders)."""
BLOCK_TOKENS = 128
"""vLLM's CPU KV block."""


@dataclass
class Models:
    v0: Path
    v1_folder: Path
    v0_model: PreTrainedModel
    v1_model: PreTrainedModel
    long_prompt: list[int]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """Version 0's directory, version 1 (its routers and experts moved a large step) staged as the swapper
    stages a pull, both loaded in transformers, and a prompt longer than one KV block."""
    root = tmp_path_factory.mktemp("moe-routing")
    v0 = create_test_model_dir("qwen3_moe", False, root / "v0", num_layers=3, max_position_embeddings=512)
    # Sharp logits and an end-of-sequence logit of 0: completions run to max_tokens (the swap comes mid-sequence).
    stored = load_file(str(v0 / "model.safetensors"))
    head = stored["lm_head.weight"] * 20
    head[load_tokenizer(v0).eos_token_id] = 0
    stored["lm_head.weight"] = head
    save_file(stored, str(v0 / "model.safetensors"), metadata={"format": "pt"})
    v1_model = load_model(v0)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in v1_model.named_parameters():
            if ".mlp." in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    signature = read_signature(v0)
    tensors = {n: to_wire(t) for n, t in stored_tensors(v1_model, list(signature))}
    folder = stage(DecodedWeights(1, version_digest(tensors), tensors), root / "staged-1", v0)
    tokenizer = load_tokenizer(v0)
    text = "Ann has 12 red pens and gives 5 to Bob. Bob already had 7 pens. "
    ids: list[int] = tokenizer(text * 20)["input_ids"]
    assert len(ids) > BLOCK_TOKENS + 10
    return Models(v0, folder, load_model(v0).eval(), v1_model.eval(), ids[: BLOCK_TOKENS + 10])


@pytest.fixture(scope="module")
async def engine(models: Models) -> AsyncIterator[Engine]:
    eng = Engine(EngineSettings(model_dir=models.v0, max_num_seqs=8, kv_cache_memory_bytes=32 << 20))
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()


def rows_of(s: Sample) -> np.ndarray:
    assert s.routing is not None
    return np.frombuffer(s.routing, np.uint8).reshape(-1, MOE_LAYERS, TOP_K)


@contextmanager
def gates(model: PreTrainedModel) -> Iterator[list[list[torch.Tensor]]]:
    """Each MoE layer's router logits of every forward inside, per layer in order."""
    seen: list[list[torch.Tensor]] = [[] for _ in range(MOE_LAYERS)]
    handles = [
        model.model.layers[1 + m].mlp.gate.register_forward_hook(
            lambda _mod, _args, out, m=m: seen[m].append(out[0].detach())
        )
        for m in range(MOE_LAYERS)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@dataclass
class Forward:
    """What a transformers forward of some tokens computed."""

    router_logits: torch.Tensor
    """[tokens, MoE layers, experts]."""
    logprobs: torch.Tensor
    """[tokens, vocabulary]: each position's log-softmax over the next token."""
    cache: Any
    """The KV cache, these tokens' included."""


def reference(model: PreTrainedModel, ids: list[int], cache: Any = None) -> Forward:
    """The forward of ``ids`` (after ``cache``'s tokens)."""
    with gates(model) as seen, torch.no_grad():
        out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    logprobs = out.logits[0].float().log_softmax(-1)
    return Forward(torch.stack([torch.cat(s) for s in seen], dim=1), logprobs, out.past_key_values)


def assert_top_k(rows: np.ndarray, logits: torch.Tensor) -> None:
    """``rows`` [tokens, layers, k] are the top-k of ``logits``, as sets, wherever the k-th and next logit are
    not a near tie."""
    assert rows.shape == (*logits.shape[:2], TOP_K)
    ordered = logits.sort(dim=-1, descending=True)
    want = ordered.indices[..., :TOP_K].sort(dim=-1).values.numpy()
    gap = (ordered.values[..., TOP_K - 1] - ordered.values[..., TOP_K]).numpy()
    same = (np.sort(rows, axis=-1) == want).all(axis=-1)
    assert same[gap > TIE].all(), f"{int((~same[gap > TIE]).sum())} decisions differ away from ties"
    assert same.mean() > 0.99


async def test_routing_has_its_shape_and_dtype_and_is_the_routers_top_k(engine: Engine, models: Models) -> None:
    assert engine.routing == rollout_pb2.RoutingLayout(
        num_moe_layers=2, top_k=2, num_experts=8, dtype=rollout_pb2.ROUTING_DTYPE_UINT8
    )
    prompt_ids, samples = await engine.sample("12+34=", 3, 1.0, 1.0, 24, seed=3)
    for s in samples:
        assert s.routing is not None and len(s.routing) == (len(prompt_ids) + len(s.token_ids) - 1) * 4
        rows = rows_of(s)
        assert_top_k(rows, reference(models.v0_model, prompt_ids + s.token_ids[:-1]).router_logits)
    # The prompt's rows are the group's: every sample has the same.
    assert all(np.array_equal(rows_of(s)[: len(prompt_ids)], rows_of(samples[0])[: len(prompt_ids)]) for s in samples)


async def test_prompt_tokens_served_from_the_prefix_cache_get_their_rows(engine: Engine, models: Models) -> None:
    prompt = models.long_prompt
    _, (first,) = await engine.sample(prompt, 1, 1.0, 1.0, 4, seed=4)
    _, (again,) = await engine.sample(prompt, 1, 1.0, 1.0, 4, seed=5)
    assert again.num_cached_tokens >= BLOCK_TOKENS, "the second request reused the cached block"
    assert_top_k(rows_of(again), reference(models.v0_model, prompt + again.token_ids[:-1]).router_logits)
    assert np.array_equal(rows_of(again)[: len(prompt)], rows_of(first)[: len(prompt)])


async def test_rows_across_a_swap_mid_sequence_come_from_the_versions_that_computed_them(
    engine: Engine, models: Models
) -> None:
    under_way = asyncio.Event()
    task = asyncio.create_task(
        engine.sample("12+34=", 2, 1.0, 1.0, 48, seed=6, on_progress=lambda n: n >= 12 and under_way.set())
    )
    waiting = asyncio.create_task(under_way.wait())
    await asyncio.wait([task, waiting], timeout=120, return_when="FIRST_COMPLETED")
    waiting.cancel()
    assert under_way.is_set() and not task.done(), "the completions were under way when the swap came"
    await engine.swap(models.v1_folder, 1, "inflight")
    prompt_ids, samples = await task
    for s in samples:
        (v_a, _, switch), (v_b, _, _) = s.version_spans
        assert (v_a, v_b) == (0, 1) and 0 < switch < len(s.token_ids)
        ids = prompt_ids + s.token_ids[:-1]
        cut = len(prompt_ids) + switch - 1  # the first position forwarded by version 1
        before = reference(models.v0_model, ids[:cut])
        after = reference(models.v1_model, ids[cut:], before.cache)  # version 1 over version 0's KV
        rows = rows_of(s)
        assert_top_k(rows[:cut], before.router_logits)
        for layer in range(MOE_LAYERS):  # each routes on what the experts below it computed
            assert_top_k(rows[cut:, layer : layer + 1], after.router_logits[:, layer : layer + 1])
        # The last MoE layer's experts feed no router: the log-probs say whether they are version 1's.
        sampled = torch.tensor(s.token_ids)
        want = torch.cat([before.logprobs[len(prompt_ids) - 1 :], after.logprobs])[torch.arange(len(sampled)), sampled]
        torch.testing.assert_close(torch.tensor(s.logprobs), want, atol=LOGPROB_ATOL, rtol=0)
        # The versions route differently: rows of version 0's router would not pass for version 1's.
        old = reference(models.v0_model, ids).router_logits
        for layer in range(MOE_LAYERS):
            top_k = old[cut:, layer].topk(TOP_K).indices.sort(-1).values.numpy()
            assert (np.sort(rows[cut:, layer], -1) != top_k).any(-1).mean() > 0.2


async def test_a_reload_in_the_pause_packs_the_experts_too(engine: Engine, models: Models) -> None:
    # swap_prepack off: vLLM's reload runs on the live model in the pause, and skips the experts' packing there too.
    prepacking = engine.settings
    engine.settings = prepacking.model_copy(update={"swap_prepack": False})
    try:
        report = await engine.swap(models.v1_folder, engine.version + 1, "drain")
    finally:
        engine.settings = prepacking
    assert not report.prepacked
    ids = models.long_prompt
    got = torch.tensor(await engine.prompt_logprobs(ids))
    want = reference(models.v1_model, ids).logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
