"""A LoRA run's generator: vLLM serves the learner's adapter over the base, as the learner scores it.

One real ``AsyncLLM`` (the CPU build, float32) on a tiny Qwen3 (q/k norms, its
own head size) with one LoRA slot; the learner (peft's layers, the base
frozen) serves its adapter as a generator pulls it, and the generator's own
path checks it (``check_adapter`` against the signature the run's settings
put over the base), stages it as a peft folder and loads it in place.

At version 0 the adapter is nonzero (B random), so the base alone would score
otherwise: the engine's log-probs must equal the learner's. Then one CISPO
step; before the new adapter is loaded the engine still scores as the old
one, far from the stepped learner (what a swap that left the adapter out
would give, so the check below has teeth); after it, the engine scores as the
stepped learner. In flight, a sequence sampled across a swap carries two
versions in its spans, and its tokens before the switch score as the old
adapter's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from asymptote.codec import DecodedWeights, read_signature
from asymptote.contracts.v1 import rollout_pb2
from asymptote.lora import LoraSettings, adapter_config, adapter_signature
from asymptote.sample import Sample
from services.embedded.build import create_test_model_dir
from services.generator.config import EngineSettings
from services.generator.engine import Engine
from services.generator.weights import check_adapter, stage
from services.learner.config import LossSettings, OptimizerSettings
from services.learner.model import completion_logprobs, empty_model, load_model, load_tokenizer, pack
from services.learner.trainer import Trainer, collate
from services.learner.weights import WeightStore

pytestmark = [pytest.mark.vllm]

LORA = LoraSettings(rank=4, alpha=8)
LOGPROB_TOL = 2e-3
"""The full-weight architecture tests' tolerance (tests/generator/test_architectures.py): vLLM's CPU
float32 kernels against the learner's float32 eager forward."""
MIN_CHANGE = 0.05
"""Least change, in nats, that an adapter (against the base) and a learner step must make."""
PROMPTS = ("What is 12 + 34?", "Fay buys 8 boxes of eggs with 11 in each box. How many eggs?")
SAMPLES = 2
MAX_TOKENS = 12

Rows = list[tuple[list[int], Sample]]


@dataclass
class Run:
    model_dir: Path
    engine: Engine
    trainer: Trainer
    tokenizer: PreTrainedTokenizerBase
    staged: Path

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)


@pytest.fixture(scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Run]:
    root = tmp_path_factory.mktemp("lora")
    model_dir = create_test_model_dir("qwen3", True, root / "qwen3")
    torch.manual_seed(0)  # peft's initialisation of A: the same adapter every run
    trainer = Trainer(
        empty_model(model_dir), LossSettings(), OptimizerSettings(lr=0.05, warmup_steps=0), lora=LORA, packing=False
    )
    trainer.start(model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B starts at zero (the policy starts as the base): a nonzero adapter at version 0
        for name, param in trainer.model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    settings = EngineSettings(model_dir=model_dir, max_num_seqs=8, kv_cache_memory_bytes=32 * 1024 * 1024)
    engine = Engine(settings, LORA)
    await engine.start()
    try:
        yield Run(model_dir, engine, trainer, load_tokenizer(model_dir), root / "staged")
    finally:
        await engine.shutdown()


def served_adapter(run: Run, version: int) -> Path:
    """The learner's adapter as ``version``, through the generator's checks and staging: a peft folder."""
    store = WeightStore(run.trainer.served_signature() or {})
    v = store.snapshot_tensors(version, run.trainer.served_tensors(store.names))
    weights = DecodedWeights(version, v.digest, v.tensors)
    signature = adapter_signature(read_signature(run.model_dir), LORA)
    check_adapter(weights, signature)
    return stage(weights, run.staged, run.model_dir, adapter_config(LORA, signature, str(run.model_dir)))


def prompts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]


async def sample_all(run: Run) -> Rows:
    rows = []
    for i, prompt in enumerate(prompts(run.tokenizer)):
        prompt_ids, samples = await run.engine.sample(prompt, SAMPLES, 1.0, 1.0, MAX_TOKENS, seed=5 + i)
        rows += [(prompt_ids, s) for s in samples]
    return rows


def learner_logprobs(model: torch.nn.Module, rows: Rows, pad_id: int) -> list[list[float]]:
    batch = pack([p for p, _ in rows], [s.token_ids for _, s in rows], pad_id)
    with torch.no_grad():
        logp = completion_logprobs(model, batch)  # type: ignore[arg-type]
    return [[float(logp[i, t]) for t in range(len(s.token_ids))] for i, (_, s) in enumerate(rows)]


def gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def sampled(rows: Rows) -> list[list[float]]:
    return [s.logprobs for _, s in rows]


async def engine_scores(run: Run, rows: Rows) -> list[list[float]]:
    """The engine's log-probs of each row's completion tokens, as its loaded adapter scores them now."""
    out = []
    for prompt_ids, s in rows:
        scored = await run.engine.prompt_logprobs(prompt_ids + s.token_ids)
        out.append(scored[len(prompt_ids) - 1 :])
    return out


def step(run: Run, rows: Rows, version: int) -> None:
    """One CISPO step on ``rows`` with mixed rewards."""
    groups = []
    for g in range(len(PROMPTS)):
        members = rows[g * SAMPLES : (g + 1) * SAMPLES]
        completions = [
            rollout_pb2.Completion(
                token_ids=s.token_ids,
                logprobs=s.logprobs,
                version_spans=[rollout_pb2.VersionSpan(version=version, start=0, end=len(s.token_ids))],
                reward=float(k % 2),
            )
            for k, (_, s) in enumerate(members)
        ]
        task = rollout_pb2.GenerationTask(task_id=f"g{g}", sampling=rollout_pb2.SamplingParams(temperature=1.0))
        groups.append(
            rollout_pb2.RolloutGroup(
                group_id=f"g{version}-{g}", task=task, prompt_token_ids=members[0][0], completions=completions
            )
        )
    metrics = run.trainer.step(collate(groups, run.pad_id), learner_version=version)
    assert metrics["optim/grad_norm"] > 0


async def test_vllm_scores_as_the_learner_with_its_adapter_at_version_0_and_after_a_swap(run: Run) -> None:
    engine, model = run.engine, run.trainer.model
    report = await engine.swap(served_adapter(run, 0), 0, "inflight")
    assert report.version == 0 and report.placement == "adapter"
    at_v0 = await sample_all(run)
    assert all(s.version_spans == [(0, 0, len(s.token_ids))] for _, s in at_v0)
    gap_v0 = gap(sampled(at_v0), learner_logprobs(model, at_v0, run.pad_id))
    base_gap = gap(sampled(at_v0), learner_logprobs(load_model(run.model_dir), at_v0, run.pad_id))

    step(run, at_v0, 0)
    folder = served_adapter(run, 1)
    # What a swap that left the adapter out would serve: the engine still holds version 0's adapter.
    left_out = gap(await engine_scores(run, at_v0), learner_logprobs(model, at_v0, run.pad_id))
    await engine.swap(folder, 1, "inflight")
    assert engine.version == 1
    rescored = gap(await engine_scores(run, at_v0), learner_logprobs(model, at_v0, run.pad_id))
    at_v1 = await sample_all(run)
    assert all(s.version_spans == [(1, 0, len(s.token_ids))] for _, s in at_v1)
    gap_v1 = gap(sampled(at_v1), learner_logprobs(model, at_v1, run.pad_id))
    print(
        f"max |dlogp| learner vs vLLM with the adapter: v0 {gap_v0:.2e}, after the swap {gap_v1:.2e} "
        f"(rescored {rescored:.2e}); base alone {base_gap:.3f}, adapter left out of the swap {left_out:.3f}"
    )
    assert gap_v0 <= LOGPROB_TOL and gap_v1 <= LOGPROB_TOL and rescored <= LOGPROB_TOL
    assert base_gap > MIN_CHANGE, "the version-0 adapter changes the numbers: the base alone would fail the check"
    assert left_out > MIN_CHANGE, "an adapter left out of the swap fails the check"


async def test_an_in_flight_adapter_swap_gives_a_sequence_two_versions(run: Run) -> None:
    engine = run.engine
    if engine.version < 1:  # run on its own: the adapter as version 0 first
        await engine.swap(served_adapter(run, 0), 0, "inflight")
    old = engine.version
    rows = await sample_all(run)
    before = {n: p.detach().clone() for n, p in run.trainer.model.named_parameters() if ".lora_" in n}
    step(run, rows, old)
    folder = served_adapter(run, old + 1)
    max_tokens, swap_after = 40, 6
    under_way = asyncio.Event()

    def progress(num_tokens: int) -> None:
        if num_tokens >= swap_after:
            under_way.set()

    prompt = prompts(run.tokenizer)[0]
    task = asyncio.create_task(engine.sample(prompt, 1, 1.0, 1.0, max_tokens, seed=3, on_progress=progress))
    await asyncio.wait_for(under_way.wait(), 120)
    report = await engine.swap(folder, old + 1, "inflight")
    prompt_ids, (s,) = await task
    print(f"in-flight adapter swap: spans {s.version_spans}, pause {report.paused_s * 1e3:.1f} ms")
    assert report.num_running == 1
    assert s.finish_reason in ("length", "stop") and len(s.version_spans) == 2, s.version_spans
    (v_a, a0, a1), (v_b, b0, b1) = s.version_spans
    assert (v_a, v_b) == (old, old + 1) and a0 == 0 and a1 == b0 and b1 == len(s.token_ids) and 0 < b0
    # The tokens before the switch were sampled by the old adapter (the learner's, restored to it here).
    head = [(prompt_ids, Sample(s.token_ids[:b0], s.logprobs[:b0], [], "", ""))]
    stepped = {n: p.detach().clone() for n, p in run.trainer.model.named_parameters() if ".lora_" in n}
    with torch.no_grad():
        params = dict(run.trainer.model.named_parameters())
        for n, t in before.items():
            params[n].copy_(t)
        old_gap = gap(sampled(head), learner_logprobs(run.trainer.model, head, run.pad_id))
        for n, t in stepped.items():
            params[n].copy_(t)
    assert old_gap <= LOGPROB_TOL
