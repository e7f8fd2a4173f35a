"""After a weight swap, no request reuses prefix-cache KV computed under older weights.

vLLM leaves its prefix cache alone across ``reload_weights``: a prompt whose
KV blocks were cached under version 0 would, after the swap to version 1,
be continued from version-0 keys and values. Off-policy data that the
staleness bound k does not see, and eval contamination: held-out prompts
repeat verbatim every eval round. The generator salts each request's cache
with the policy version it is submitted under (``prefix_cache_salt``), so
a prompt cached before the swap is computed afresh after it, while
sequences in flight keep their own KV (PipelineRL).

The check: a prompt longer than one KV block (128 tokens on the CPU
backend, so one full block is cached) is sampled under version 0, the
engine swaps to version 1, and the prompt is sampled again. The
completion's log-probs must equal a full recompute of the same tokens
under version 1 (vLLM's prompt log-probs, which never read the cache: a
fresh engine loaded with version 1 computes them the same way). Its twin,
an engine with the salt off, must fail that check.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from asymptote.codec import DecodedWeights, read_signature, version_digest
from services.generator.config import EngineSettings
from services.generator.engine import Engine
from services.generator.weights import stage
from services.learner.build import create_test_model_dir
from services.learner.model import load_model, load_tokenizer
from services.learner.weights import to_wire

pytestmark = [pytest.mark.vllm]

LOGPROB_TOL = 2e-3
"""A fresh computation under version 1 against the recompute: vLLM's CPU kernels agree to ~1e-6."""
MIN_STALE_GAP = 0.05
"""Version-0 KV for the prompt moves the completion's log-probs by more than this (measured: see the twin)."""
BLOCK_TOKENS = 128


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[int]]:
    root = tmp_path_factory.mktemp("prefix-cache")
    v0_dir = create_test_model_dir("llama", False, root / "v0")
    model = load_model(v0_dir)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a large step, so stale KV shows
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    signature = read_signature(v0_dir)
    tensors = {n: to_wire(t) for n, t in model.state_dict().items() if n in signature}
    folder = stage(DecodedWeights(1, version_digest(tensors), tensors), root / "staged", v0_dir)
    tokenizer = load_tokenizer(v0_dir)
    text = "Ann has 12 red pens and gives 5 to Bob. Bob already had 7 pens. "
    ids: list[int] = []
    while len(ids) <= BLOCK_TOKENS + 20:
        ids = tokenizer(text)["input_ids"]
        text += text
    return v0_dir, folder, ids[: BLOCK_TOKENS + 20]


async def cached_then_swapped(model_dir: Path, folder: Path, prompt_ids: list[int], salt: str) -> tuple[float, float]:
    """(largest |sampled - recomputed| log-prob after the swap, seconds of that sampling)."""
    settings = EngineSettings.model_validate(
        {"model_dir": model_dir, "max_num_seqs": 8, "kv_cache_memory_bytes": 32 << 20, "prefix_cache_salt": salt}
    )
    engine = Engine(settings)
    await engine.start()
    try:
        tokenizer = load_tokenizer(model_dir)
        prompt = tokenizer.decode(prompt_ids)
        await engine.sample(prompt, 1, 1.0, 1.0, 2, seed=1)  # version 0 caches the prompt's first block
        await engine.swap(folder, 1, "drain")
        started = time.perf_counter()
        ids, samples = await engine.sample(prompt, 2, 1.0, 1.0, 8, seed=5)
        elapsed = time.perf_counter() - started
        assert len(ids) > BLOCK_TOKENS
        worst = 0.0
        for s in samples:
            recomputed = (await engine.prompt_logprobs(ids + s.token_ids))[len(ids) - 1 :]
            worst = max(worst, max(abs(a - b) for a, b in zip(recomputed, s.logprobs)))
        return worst, elapsed
    finally:
        await engine.shutdown()


async def test_a_prompt_cached_before_a_swap_is_computed_afresh_after_it(
    models: tuple[Path, Path, list[int]],
) -> None:
    model_dir, folder, prompt_ids = models
    gap, seconds = await cached_then_swapped(model_dir, folder, prompt_ids, "version")
    print(f"salted: max |dlogp| {gap:.2e}, sampling after the swap {seconds * 1e3:.1f} ms")
    assert gap <= LOGPROB_TOL


async def test_without_the_salt_the_stale_prefix_is_reused(models: tuple[Path, Path, list[int]]) -> None:
    """The check has teeth: vLLM alone serves the version-0 KV of the cached block after the swap."""
    model_dir, folder, prompt_ids = models
    gap, seconds = await cached_then_swapped(model_dir, folder, prompt_ids, "none")
    print(f"unsalted: max |dlogp| {gap:.2e}, sampling after the swap {seconds * 1e3:.1f} ms")
    assert gap > MIN_STALE_GAP
