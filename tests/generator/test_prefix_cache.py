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
backend, so one full block is cached) is sampled under the engine's
version, the engine swaps to the next version (the other of two weight
sets a large step apart), and the prompt is sampled again. The
completion's log-probs must equal a full recompute of the same tokens
under the new version (vLLM's prompt log-probs, which never read the
cache: a fresh engine loaded with that version computes them the same
way). Its twin, on the same engine with the salt off, must fail that
check.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest
import torch

from asymptote.codec import DecodedWeights, read_signature, version_digest
from services.embedded.build import create_test_model_dir
from services.generator.config import EngineSettings
from services.generator.engine import Engine
from services.generator.weights import stage
from services.learner.model import load_model, load_tokenizer
from services.learner.weights import to_wire

pytestmark = [pytest.mark.vllm]

LOGPROB_TOL = 2e-3
"""A fresh computation under version 1 against the recompute: vLLM's CPU kernels agree to ~1e-6."""
MIN_STALE_GAP = 0.05
"""Version-0 KV for the prompt moves the completion's log-probs by more than this (measured: see the twin)."""
BLOCK_TOKENS = 128


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], list[int]]:
    """The model directory (version 0), two staged weight sets a large step apart (version 0's weights
    and a perturbed copy), and a prompt of more than one KV block."""
    root = tmp_path_factory.mktemp("prefix-cache")
    v0_dir = create_test_model_dir("llama", False, root / "v0")
    model = load_model(v0_dir)
    signature = read_signature(v0_dir)
    folders = []
    for i in range(2):
        if i:
            generator = torch.Generator().manual_seed(3)
            with torch.no_grad():  # a large step, so stale KV shows
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator) * 0.05)
        tensors = {n: to_wire(t) for n, t in model.state_dict().items() if n in signature}
        folders.append(stage(DecodedWeights(i, version_digest(tensors), tensors), root / f"staged-{i}", v0_dir))
    tokenizer = load_tokenizer(v0_dir)
    text = "Ann has 12 red pens and gives 5 to Bob. Bob already had 7 pens. "
    ids: list[int] = []
    while len(ids) <= BLOCK_TOKENS + 20:
        ids = tokenizer(text)["input_ids"]
        text += text
    return v0_dir, folders, ids[: BLOCK_TOKENS + 20]


@pytest.fixture(scope="module")
async def engine(models: tuple[Path, list[Path], list[int]]) -> AsyncIterator[Engine]:
    """One engine for both checks: the salt is read per request, from the engine's settings."""
    settings = EngineSettings(model_dir=models[0], max_num_seqs=8, kv_cache_memory_bytes=32 << 20)
    eng = Engine(settings)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()


async def cached_then_swapped(
    engine: Engine, models: tuple[Path, list[Path], list[int]], salt: Literal["version", "none"]
) -> tuple[float, float]:
    """With ``salt``: the prompt cached under the engine's version, a swap to the other weight set, the
    prompt sampled again; (largest |sampled - recomputed| log-prob after the swap, seconds of that sampling)."""
    model_dir, folders, prompt_ids = models
    engine.settings = engine.settings.model_copy(update={"prefix_cache_salt": salt})
    tokenizer = load_tokenizer(model_dir)
    prompt = tokenizer.decode(prompt_ids)
    await engine.sample(prompt, 1, 1.0, 1.0, 2, seed=1)  # the current version caches the prompt's first block
    version = engine.version + 1
    await engine.swap(folders[version % 2], version, "drain")  # the other weights: version 0's are folders[0]
    started = time.perf_counter()
    ids, samples = await engine.sample(prompt, 2, 1.0, 1.0, 8, seed=5)
    elapsed = time.perf_counter() - started
    assert len(ids) > BLOCK_TOKENS
    worst = 0.0
    for s in samples:
        recomputed = (await engine.prompt_logprobs(ids + s.token_ids))[len(ids) - 1 :]
        worst = max(worst, max(abs(a - b) for a, b in zip(recomputed, s.logprobs)))
    return worst, elapsed


async def test_a_prompt_cached_before_a_swap_is_computed_afresh_after_it(
    engine: Engine, models: tuple[Path, list[Path], list[int]]
) -> None:
    gap, seconds = await cached_then_swapped(engine, models, "version")
    print(f"salted: max |dlogp| {gap:.2e}, sampling after the swap {seconds * 1e3:.1f} ms")
    assert gap <= LOGPROB_TOL


async def test_without_the_salt_the_stale_prefix_is_reused(
    engine: Engine, models: tuple[Path, list[Path], list[int]]
) -> None:
    """The check has teeth: vLLM alone serves the older version's KV of the cached block after the swap."""
    gap, seconds = await cached_then_swapped(engine, models, "none")
    print(f"unsalted: max |dlogp| {gap:.2e}, sampling after the swap {seconds * 1e3:.1f} ms")
    assert gap > MIN_STALE_GAP
