"""Interruption length control on a real vLLM engine, end to end through the rollout loop.

One real ``AsyncLLM`` (the CPU build) serves a tiny random Llama with a BPE
tokenizer and ChatML template, shaped so that what matters is certain: a
constant feature in every embedding lets the LM head suppress the end of
sequence and ``</think>`` outright (so the model never closes its thinking
and interruption fires every time) and favour the token "7" (about half the
tokens, so an answer contains one and log-probs are not trivially 0). A
dataset task with a small thinking budget goes through the real rollout
loop over a real nats-server; the published group is checked as the learner
would take it: the phrase in the text, the loss mask excluding exactly the
phrase's tokens, the version spans covering everything else, the learner's
own log-probs of the sampled tokens (continuation included) equal to the
engine's, and the reward equal to the verifier's verdict on the final text.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asymptote.compute import ComputeMeter
from asymptote.contracts.v1 import rollout_pb2
from asymptote.jetstream.names import Names, ensure_streams
from asymptote.messages import decode_group
from asymptote.nats_local import nats_server
from asymptote.tasks import DatasetSettings, LengthControlSettings
from asymptote.tasks.length import draw_thinking_budget
from asymptote.tasks.verifiers import RegexSettings, make_verifier, reward
from services.embedded.build import ModelSpec, build_model, save_model_dir, train_bpe_tokenizer, word_problem_corpus
from services.generator.config import EngineSettings
from services.generator.engine import Engine
from services.generator.metrics import GeneratorMetrics
from services.generator.rollout import RolloutLoop
from services.generator.scoring import TaskScorer
from services.learner.model import PolicyForward, load_model
from services.learner.trainer import collate

pytestmark = [pytest.mark.vllm]

FAVOURED = "7"
PHRASE = " Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
LENGTH = LengthControlSettings(thinking_budget_tokens=(6, 12), answer_budget_tokens=16, interruption_phrase=PHRASE)
GROUP_SIZE = 4
MAX_TOKENS = 120
LOGPROB_TOL = 2e-3
"""vLLM's CPU kernels against transformers' eager float32 forward (observed ~1e-5, see test_swap.py)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("length")
    tok = train_bpe_tokenizer(word_problem_corpus(), 512)
    spec = ModelSpec(
        family="llama",
        tie_word_embeddings=False,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
        init_seed=5,
    )
    net = build_model(spec, tok)
    vocab = tok.convert_ids_to_tokens(list(range(len(tok))))
    with torch.no_grad():
        # Dimension 0 of every embedding is a constant, dominant feature (~+11 after the final norm).
        net.model.embed_tokens.weight[:, 0] = 1.0
        head = net.lm_head.weight
        head[:, 0] = 0.0
        head[tok.convert_tokens_to_ids(FAVOURED), 0] = 0.55
        # No end of sequence and nothing that could spell </think>: the model never stops thinking.
        for i, t in enumerate(vocab):
            if i == tok.eos_token_id or "<" in t or ">" in t:
                head[i, 0] = -2.0
    model_dir = save_model_dir(net, tok, root / "model")
    return {"dir": model_dir, "tok": tok, "root": root}


@pytest.fixture(scope="module")
async def engine(model: dict[str, Any]) -> AsyncIterator[Engine]:
    eng = Engine(
        EngineSettings(
            model_dir=model["dir"], max_num_seqs=16, max_model_len=256, kv_cache_memory_bytes=64 * 1024 * 1024
        )
    )
    await eng.start()
    try:
        yield eng
    finally:
        await eng.shutdown()


def _settings(root: Path, length: LengthControlSettings) -> DatasetSettings:
    # The generator never reads the dataset files: the path need not exist.
    return DatasetSettings(
        path=root / "absent.jsonl", holdout_fraction=0.1, verifier=RegexSettings(), length_control=length
    )


def _task(task_id: str) -> rollout_pb2.GenerationTask:
    return rollout_pb2.GenerationTask(
        task_id=task_id,
        kind=rollout_pb2.TASK_KIND_TRAIN,
        task_name="dataset",
        prompt_id=task_id,
        prompt="Ada has 3 apples and buys 4 more. How many apples does she have?",
        reference=FAVOURED,  # the regex the answer must contain
        sampling=rollout_pb2.SamplingParams(
            num_samples=GROUP_SIZE, temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=11
        ),
    )


async def _one_group(engine: Engine, scorer: TaskScorer, metrics: GeneratorMetrics, root: Path) -> Any:
    """Run the rollout loop over a real nats-server until it publishes the group of one task."""
    import nats as nats_py

    names = Names("lengthtest")
    with nats_server(root / "nats") as server:
        nc = await nats_py.connect(server.url)
        try:
            js = nc.jetstream()
            await ensure_streams(js, names)
            loop = RolloutLoop(
                engine,
                js,
                names,
                "gen-test",
                max_inflight_groups=2,
                ack_wait_s=30.0,
                metrics=metrics,
                meter=ComputeMeter("generator", "gen-test", "cpu", 1),
                scorer=scorer,
            )
            stop = asyncio.Event()
            running = asyncio.create_task(loop.run(stop))
            task = _task("train-length")
            task.task_digest = scorer.digest  # the broker's task is this generator's
            await js.publish(names.train_tasks, task.SerializeToString(), headers={"Nats-Msg-Id": task.task_id})
            sub = await js.pull_subscribe(names.rollouts, durable="check", stream=names.rollouts_stream)
            msgs: list[Any] = []
            deadline = asyncio.get_running_loop().time() + 180
            while not msgs and asyncio.get_running_loop().time() < deadline:
                try:
                    msgs = await sub.fetch(1, timeout=1)
                except TimeoutError:
                    pass
            stop.set()
            await asyncio.wait_for(running, 60)
            assert msgs, "no rollout group published within 180 s"
            return decode_group(msgs[0].data)  # validated as the broker validates it
        finally:
            await nc.close()


async def test_interrupted_completions_reach_the_learner_masked_and_scored(
    engine: Engine, model: dict[str, Any]
) -> None:
    tok = model["tok"]
    metrics = GeneratorMetrics()
    scorer = TaskScorer(_settings(model["root"], LENGTH), model["dir"], metrics)
    try:
        group = await _one_group(engine, scorer, metrics, model["root"])
    finally:
        scorer.close()
    phrase_ids = tok.encode(PHRASE, add_special_tokens=False)
    budget = draw_thinking_budget(LENGTH, "train-length")
    k = len(phrase_ids)
    verifier = make_verifier(RegexSettings())
    for c in group.completions:
        ids = list(c.token_ids)
        # The first part ran to the budget, then the phrase, then at most the answer budget.
        assert c.interrupted and ids[budget : budget + k] == phrase_ids
        assert 0 < len(ids) - budget - k <= LENGTH.answer_budget_tokens
        assert PHRASE in c.text and c.text.index(PHRASE) > 0
        # The loss mask excludes exactly the phrase's tokens, which have no sampling log-prob.
        assert list(c.loss_mask) == [1] * budget + [0] * k + [1] * (len(ids) - budget - k)
        assert list(c.logprobs)[budget : budget + k] == [0.0] * k
        # Spans cover every other token: the first part, then the continuation past the phrase.
        covered = [i for s in c.version_spans for i in range(s.start, s.end)]
        assert covered == [i for i in range(len(ids)) if not budget <= i < budget + k]
        assert {s.version for s in c.version_spans} == {0}
        # The reward is the verifier's verdict on the final text (the answer after the phrase's </think>).
        answer = c.text.split("</think>")[-1]
        assert FAVOURED in answer  # the model favours it: about half its tokens
        assert c.reward == reward(verifier.verdict(c.text, FAVOURED), "binary") == 1.0
    # Counted over every completion: all interrupted; truncated: those that used the whole answer budget.
    num_truncated = sum(len(c.token_ids) == budget + k + LENGTH.answer_budget_tokens for c in group.completions)
    assert [c.truncated for c in group.completions].count(True) == num_truncated
    assert metrics.completions.labels("train")._value.get() == GROUP_SIZE
    assert metrics.completions_interrupted.labels("train")._value.get() == GROUP_SIZE
    assert metrics.completions_truncated.labels("train")._value.get() == num_truncated

    # The learner's mask from the message, and its own log-probs of the sampled tokens: equal to the
    # engine's on every token in the loss, the continuation's included.
    inputs = collate([group], pad_id=tok.pad_token_id)
    assert inputs.loss_mask.sum().item() == sum(len(c.token_ids) - k for c in group.completions)
    with torch.no_grad():
        logp, _ = PolicyForward(load_model(model["dir"]).eval())(inputs.batch, inputs.temperature)
    in_loss = inputs.loss_mask.bool()
    diff = (logp - inputs.logp_gen)[in_loss].abs()
    assert diff.max().item() < LOGPROB_TOL, diff.max().item()
    after = torch.zeros_like(in_loss)
    after[:, budget + k :] = True
    assert (in_loss & after).sum() > 0  # the comparison covers continuation tokens


async def test_a_closed_thinking_continues_without_the_phrase_from_the_prefix_cache(
    engine: Engine, model: dict[str, Any]
) -> None:
    """With the favoured token as the end of thinking, the first part stops at it and continues for the
    answer budget: nothing injected, every token in the loss, the continuation's prompt served from the
    prefix cache."""
    closes = LENGTH.model_copy(update={"think_end": FAVOURED, "thinking_budget_tokens": (40, 40)})
    scorer = TaskScorer(_settings(model["root"], closes), model["dir"], GeneratorMetrics())
    length = scorer.length_control("dataset")
    assert length is not None and scorer.length_control("arithmetic") is None
    # Long enough to fill one of vLLM's KV blocks (128 tokens on the CPU), the unit the prefix cache shares.
    prompt = scorer.prompt("dataset", "Ada has 3 apples and buys 4 more. " * 16 + "How many apples?")
    prompt_ids, samples = await length.sample(engine, "t-closed", prompt, GROUP_SIZE, 1.0, 1.0, MAX_TOKENS, seed=3)
    tok = model["tok"]
    block = engine._llm.vllm_config.cache_config.block_size
    assert len(prompt_ids) > block
    for s in samples:
        # The first part is the tokens up to the first that spells the end of thinking (within the budget).
        num_first = next(i for i in range(1, len(s.token_ids) + 1) if FAVOURED in tok.decode(s.token_ids[:i]))
        assert num_first <= draw_thinking_budget(closes, "t-closed")
        assert 0 < len(s.token_ids) - num_first <= closes.answer_budget_tokens
        assert not s.interrupted and s.loss_mask == [] and PHRASE not in s.text
        assert [i for _, a, b in s.version_spans for i in range(a, b)] == list(range(len(s.token_ids)))
        # The continuation's prompt (prompt + first part) came from the cache, up to its last full block
        # (the first part's last token was sampled, never fed to the model).
        assert s.num_cached_tokens >= (len(prompt_ids) + num_first - 1) // block * block > 0
    scorer.close()
