"""A multi-turn task from the broker through a generator's rollout loop to the learner's batch.

Over a real nats-server: a real broker issues a multi-turn task (a dataset
of ten problems, a deterministic environment), a real rollout loop plays
its episodes on a real vLLM engine (the tiny Qwen3 with a tool-calling
chat template, tests/envs/chat_models.py) against environments in worker
processes, and publishes each group; the broker validates and batches
them and the test takes a batch over gRPC as the learner does. Every
episode the loop played is recorded, and each group the learner gets is
checked against them:

- its completions are the episodes' training samples in order: token ids,
  log-probs, loss masks, version spans and text as the episode kept them,
  each sequence's prompt (the group's, or its own), and the flag of a
  sequence that continues an episode;
- environment tokens are out of the loss (mask 0, log-prob 0, no span),
  as many as the episode reports; every model token is in it;
- the group's prompt decodes to the chat template's rendering of the
  environment's first messages for the problem's formatted prompt;
- rewards: the environment's for an episode it ended (``Counter`` gives
  its number of turns), else the dataset verifier's on the final turn,
  judged again here in process;
- the group's version range spans every sequence's spans;
- the learner's collation of the batch, through its own forward pass,
  gives the engine's log-probs on every token in the loss (each sequence
  read on its own prompt).

The eval round at the first version is played the same way, and its
results count episodes. The generator's episode metrics add up to the
episodes played.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter as Tally
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_broker_nats import Harness, next_batch, running, stream_count
from transformers import AutoTokenizer

from asymptote.compute import ComputeMeter
from asymptote.contracts.v1 import rollout_pb2
from asymptote.envs import EnvironmentPool, EnvTask
from asymptote.ledger import audit, read_entries
from asymptote.nats_local import NatsServer
from asymptote.tasks import DatasetTask, MultiTurnSettings, parse_task_settings
from asymptote.tasks.multiturn import episode_prompt
from services.broker.config import EvalSettings, SamplingSettings
from services.generator.engine import Engine
from services.generator.episode import END_REASONS, Episode, EpisodeRunner
from services.generator.metrics import GeneratorMetrics
from services.generator.rollout import RolloutLoop
from services.generator.scoring import TaskScorer
from services.learner.model import completion_logprobs, load_model
from services.learner.trainer import collate
from tests.envs.tool_classes import GATE_ENV, Counter
from tests.helpers.waiting import wait_until_async

pytestmark = [pytest.mark.vllm]

GROUP_SIZE = 3
NUM_BATCHES = 2
BATCH_PROMPTS = 2
LOGPROB_TOL = 2e-4
"""vLLM's CPU float32 kernels against the learner's eager float32 forward: about 1e-6 measured here. Tighter
than test_episodes.py's bound, since this tiny model's log-probs move little with their context: a
re-rendered sequence read on the group's prompt instead of its own was off by 4e-3 at most."""
ROWS = [{"id": f"q{i}", "prompt": f"Say {i} words.", "answer": str(2 if i % 2 else 9)} for i in range(10)]
"""Counter ends an episode after ``answer`` turns: 2 within max_turns (the environment's reward), 9 never
(the episode runs out of turns or tokens, and the verifier judges its final turn)."""


class RecordingRunner(EpisodeRunner):
    """The episode runner, keeping every episode it plays under its task, in the order they were started."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.played: dict[str, list[Episode | None]] = defaultdict(list)

    async def run(self, task: EnvTask, temperature: float, top_p: float, seed: int = 0, **kwargs: Any) -> Episode:
        slot = len(self.played[task.task_id])
        self.played[task.task_id].append(None)
        episode = await super().run(task, temperature, top_p, seed, **kwargs)
        self.played[task.task_id][slot] = episode
        return episode


@pytest.fixture(scope="module")
def engine(qwen3_chat_engine: tuple[Path, Engine]) -> Engine:
    """The session's engine of the tiny Qwen3 chat model (tests/conftest.py), shared with the episode tests."""
    return qwen3_chat_engine[1]


def multiturn_task(
    root: Path,
    chat_template_kwargs: dict[str, Any],
    rows: list[dict[str, str]] = ROWS,
    entry: str = "tests.envs.tool_classes:Counter",
    tool_timeout_s: float = 30.0,
) -> MultiTurnSettings:
    path = root / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = parse_task_settings(
        {
            "name": "multiturn",
            "dataset": {"path": str(path), "holdout_fraction": 0.2, "prompt_format": "Please: {prompt}"},
            "environment": {
                "entry": entry,
                "max_turns": 3,
                "max_turn_tokens": 10,
                "cut_turn": "continue",
                "max_episode_tokens": 84,
                "tool_timeout_s": tool_timeout_s,
                "num_workers": 4,
            },
            "chat_template_kwargs": chat_template_kwargs,
        }
    )
    assert isinstance(settings, MultiTurnSettings)
    return settings


def harness(nats: NatsServer, settings: MultiTurnSettings, **kwargs: Any) -> Harness:
    """A broker issuing ``settings``' task in groups of GROUP_SIZE, with an eval round at the first version."""
    h = Harness(nats, batch_prompts=BATCH_PROMPTS, outstanding=4, **kwargs)
    h.config = h.config.model_copy(
        update={
            "task": settings,
            "sampling": SamplingSettings(group_size=GROUP_SIZE, max_tokens=16),
            "eval": EvalSettings(every_versions=1000, num_samples=2),
        }
    )
    return h


def rollout_loop(
    h: Harness,
    engine: Engine,
    metrics: GeneratorMetrics,
    scorer: TaskScorer,
    episodes: EpisodeRunner,
    max_inflight_groups: int = 4,
) -> RolloutLoop:
    return RolloutLoop(
        engine,
        h.js,
        h.names,
        "generator-multiturn",
        max_inflight_groups=max_inflight_groups,
        ack_wait_s=30.0,
        metrics=metrics,
        meter=ComputeMeter("generator", "generator-multiturn", "cpu", 1),
        scorer=scorer,
        episodes=episodes,
    )


@contextlib.asynccontextmanager
async def looping(loop: RolloutLoop, eval_sub: Any) -> AsyncIterator[None]:
    """``loop`` generating for the block; then stopped (its in-flight groups drained) and ``eval_sub`` closed."""
    stop = asyncio.Event()
    generating = asyncio.create_task(loop.run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(generating, 60)
        await eval_sub.unsubscribe()


async def eval_results(sub: Any, count: int) -> list[rollout_pb2.EvalResult]:
    """``count`` eval results from ``sub``, each acked, within 120 s."""
    results: list[rollout_pb2.EvalResult] = []

    async def arrived() -> bool:
        try:
            msgs = await sub.fetch(count, timeout=1.0)
        except TimeoutError:
            msgs = []
        for m in msgs:
            results.append(rollout_pb2.EvalResult.FromString(m.data))
            await m.ack()
        return len(results) >= count

    await wait_until_async(arrived, 120, f"{count} eval results")
    return results


def expected_reward(episode: Episode, verifier: DatasetTask, reference: str) -> float:
    """The environment's reward when it ended the episode (Counter's: its turns); else the verifier's."""
    if episode.end_reason == "done":
        assert episode.reward == float(episode.num_turns)
        return episode.reward
    assert episode.reward is None
    return verifier.score(episode.final_turn, reference)


def masks(episode: Episode) -> list[int]:
    """Every sequence's loss mask of ``episode``, one after another."""
    return [m for t in episode.samples for m in (t.sample.loss_mask or [1] * len(t.sample.token_ids))]


def check_group(group: rollout_pb2.RolloutGroup, episodes: list[Episode], verifier: DatasetTask) -> None:
    assert len(episodes) == GROUP_SIZE
    sequences = [(e, j, t) for e in episodes for j, t in enumerate(e.samples)]
    assert len(group.completions) == len(sequences)
    group_prompt = list(group.prompt_token_ids)
    assert group_prompt == episodes[0].samples[0].prompt_ids
    spans = []
    for c, (episode, j, t) in zip(group.completions, sequences, strict=True):
        s = t.sample
        assert list(c.token_ids) == s.token_ids
        assert list(c.logprobs) == pytest.approx(s.logprobs, abs=0)
        assert list(c.loss_mask) == s.loss_mask
        assert [(v.version, v.start, v.end) for v in c.version_spans] == [tuple(x) for x in s.version_spans]
        assert c.text == s.text
        assert list(c.prompt_token_ids or group_prompt) == t.prompt_ids
        assert c.continues_episode == (j > 0)
        # The environment's tokens are out of the loss, as many as the episode says; the model's are in.
        mask = list(c.loss_mask) or [1] * len(c.token_ids)
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, mask) if not m)
        covered = {i for v in c.version_spans for i in range(v.start, v.end)}
        assert covered == {i for i, m in enumerate(mask) if m}
        if j == 0:
            assert masks(episode).count(0) == episode.num_env_tokens
        assert c.reward == expected_reward(episode, verifier, group.task.reference)
        spans += [v.version for v in c.version_spans]
    assert (group.min_version, group.max_version) == (min(spans), max(spans))


@pytest.mark.parametrize("thinking", [None, False], ids=["extended", "resplit"])
async def test_a_multiturn_task_trains_through_broker_generator_and_batches(
    nats: NatsServer, engine: Engine, tmp_path: Path, thinking: bool | None
) -> None:
    """extended: the template extends the history, one sequence an episode. resplit: Qwen3's template with
    thinking off drops each earlier turn's empty think block, so every turn starts a sequence of its own."""
    settings = multiturn_task(tmp_path, {} if thinking is None else {"enable_thinking": thinking})
    h = harness(nats, settings, zero_variance="keep")
    tokenizer = AutoTokenizer.from_pretrained(str(engine.settings.model_dir))
    verifier = DatasetTask(settings.dataset)
    metrics = GeneratorMetrics()
    pool = EnvironmentPool(settings.environment)
    await pool.start()
    runner = RecordingRunner(engine, tokenizer, pool, settings.chat_template_kwargs)
    scorer = TaskScorer(settings, engine.settings.model_dir, metrics)
    try:
        async with running(h):
            eval_sub = await h.js.pull_subscribe(h.names.eval_results, durable="test", stream=h.names.evals_stream)
            loop = rollout_loop(h, engine, metrics, scorer, runner)
            groups: list[rollout_pb2.RolloutGroup] = []
            async with looping(loop, eval_sub):
                for _ in range(NUM_BATCHES):
                    header, batch = await next_batch(h, timeout_s=120.0)
                    assert header.num_groups == BATCH_PROMPTS, header
                    groups += batch
                num_heldout = len(verifier.problems("heldout"))
                results = await eval_results(eval_sub, num_heldout)
    finally:
        scorer.close()
        pool.close()

    # Episodes of tasks the loop was still playing when it stopped are not in any group: only finished ones.
    played = {task_id: [e for e in episodes if e is not None] for task_id, episodes in runner.played.items()}
    for group in groups:
        check_group(group, played[group.group_id], verifier)
        # The group's prompt: the template's rendering of the environment's first messages.
        env_task = EnvTask(prompt=episode_prompt(settings, group.task.prompt), reference=group.task.reference)
        messages, tools = await Counter().reset(env_task)
        rendered = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **settings.chat_template_kwargs
        )
        assert tokenizer.decode(list(group.prompt_token_ids), skip_special_tokens=False) == rendered
    # Both ways an episode's reward comes: from the environment and from the verifier.
    batched = [e for g in groups for e in played[g.group_id]]
    ends = Tally(e.end_reason for e in batched)
    print(
        f"{len(groups)} groups, {sum(len(g.completions) for g in groups)} sequences; episodes by end: {dict(ends)}; "
        f"rewards: {sorted(Tally(c.reward for g in groups for c in g.completions).items())}; "
        f"environment tokens: {sum(e.num_env_tokens for e in batched)}; model tokens: "
        f"{sum(masks(e).count(1) for e in batched)}; turns: {sorted(Tally(e.num_turns for e in batched).items())}; "
        f"sequences with their own prompt: {sum(bool(c.prompt_token_ids) for g in groups for c in g.completions)}"
    )
    assert ends["done"] and set(ends) - {"done"}, ends
    if thinking is None:
        assert all(len(e.samples) == 1 for e in batched)
        assert sum(e.num_env_tokens for e in batched) > 0
    else:
        # Every turn after the first is a sequence on its own prompt, continuing its episode.
        # (An episode out of room after a re-render has counted one more resplit than it has sequences.)
        assert all(len(e.samples) == e.num_turns and e.num_resplits >= e.num_turns - 1 for e in batched)
        assert all(c.prompt_token_ids and c.continues_episode for g in groups for c in g.completions[1:2])

    # The learner lays the batch out (each sequence on its own prompt) and scores every token in the loss as
    # the engine sampled it: the prompts the engine continued are the ones the learner reads.
    inputs = collate(groups, int(tokenizer.pad_token_id))
    with torch.no_grad():
        logp = completion_logprobs(load_model(engine.settings.model_dir), inputs.batch)
    in_loss = inputs.loss_mask.bool()
    gap = float((logp - inputs.logp_gen).abs()[in_loss].max())
    print(f"learner vs engine log-probs over {int(in_loss.sum())} tokens in the loss: max gap {gap:.2e}")
    assert gap <= LOGPROB_TOL

    # An eval result counts episodes: one sample each, correct when its reward is positive.
    references = {p.prompt_id: p.reference for p in verifier.problems("heldout")}
    assert {r.prompt_id for r in results} == set(references)
    for result in results:
        episodes = played[result.task_id]
        assert result.num_samples == len(episodes) == 2
        rewards = [expected_reward(e, verifier, references[result.prompt_id]) for e in episodes]
        assert result.num_correct == sum(r > 0 for r in rewards)
        # Tokens the engine sampled: the environment's are not counted.
        assert result.num_tokens == sum(masks(e).count(1) for e in episodes)

    # The metrics add up to the episodes played (train and eval).
    everything = [e for episodes in played.values() for e in episodes]
    counted = sum(
        metrics.registry.get_sample_value("asymptote_generator_episodes_total", {"kind": k, "reason": r}) or 0.0
        for k in ("train", "eval")
        for r in END_REASONS
    )
    assert counted == len(everything)
    assert metrics.registry.get_sample_value("asymptote_generator_episode_turns_sum") == sum(
        e.num_turns for e in everything
    )
    assert metrics.registry.get_sample_value("asymptote_generator_environment_tokens_total") == sum(
        e.num_env_tokens for e in everything
    )
    assert metrics.registry.get_sample_value("asymptote_generator_tool_calls_total") == sum(
        e.num_tool_calls for e in everything
    )
    env_s = metrics.registry.get_sample_value("asymptote_generator_environment_seconds_total")
    assert env_s is not None and env_s == pytest.approx(sum(e.env_s for e in everything)) and env_s > 0


NUM_REFUSED_TRAIN = 6


async def test_tasks_whose_environment_fails_at_reset_end_once_with_the_reason(
    nats: NatsServer, engine: Engine, tmp_path: Path
) -> None:
    """An environment that raises at reset: no episode of the task has a sequence. A train task is
    dead-lettered once, naming the episodes' end, and the ledger counts it (nothing lost, nothing handed
    back to be played again); an eval task scores its episodes as wrong answers, so its round completes;
    every episode is counted by its end reason."""
    rows = [{"id": f"q{i}", "prompt": f"Say {i} words.", "answer": "reset-raise"} for i in range(10)]
    settings = multiturn_task(tmp_path, {}, rows, entry="tests.envs.tool_classes:Misbehaves")
    h = harness(nats, settings)
    tokenizer = AutoTokenizer.from_pretrained(str(engine.settings.model_dir))
    metrics = GeneratorMetrics()
    pool = EnvironmentPool(settings.environment)
    await pool.start()
    scorer = TaskScorer(settings, engine.settings.model_dir, metrics)
    num_heldout = len(DatasetTask(settings.dataset).problems("heldout"))
    try:
        async with running(h):
            eval_sub = await h.js.pull_subscribe(h.names.eval_results, durable="test", stream=h.names.evals_stream)
            loop = rollout_loop(
                h, engine, metrics, scorer, EpisodeRunner(engine, tokenizer, pool, settings.chat_template_kwargs)
            )

            async def refused_train() -> bool:
                entries = await read_entries(h.js, h.names)
                return sum(e.event == rollout_pb2.LEDGER_EVENT_DEADLETTERED for e in entries) >= NUM_REFUSED_TRAIN

            async with looping(loop, eval_sub):
                await wait_until_async(refused_train, 120, f"{NUM_REFUSED_TRAIN} refused train tasks in the ledger")
                results = await eval_results(eval_sub, num_heldout)
            sub = await h.js.subscribe(h.names.deadletter("tasks"), ordered_consumer=True)
            letters = [await sub.next_msg(timeout=5) for _ in range(await stream_count(h, h.names.deadletter_stream))]
            await sub.unsubscribe()
            num_groups = await stream_count(h, h.names.rollouts_stream)
            ledger = await audit(h.js, h.names)
    finally:
        scorer.close()
        pool.close()

    # Each refused task once (never handed back and refused again), with the episodes' end as its reason.
    refused = [rollout_pb2.GenerationTask.FromString(m.data) for m in letters]
    assert all(t.kind == rollout_pb2.TASK_KIND_TRAIN for t in refused)
    assert len({t.task_id for t in refused}) == len(refused) >= NUM_REFUSED_TRAIN
    for m in letters:
        reason = (m.headers or {})["Asymptote-Reason"]
        assert reason.startswith(f"none of the task's {GROUP_SIZE} episodes produced a sequence (env_raised: "), reason
        assert "the environment could not start" in reason, reason
    assert num_groups == 0  # nothing to train on was published
    # The eval round completes: every episode counted, none correct.
    assert len(results) == num_heldout and all((r.num_samples, r.num_correct) == (2, 0) for r in results)
    # Counted: the refusals, and every episode by its end.
    value = metrics.registry.get_sample_value
    assert value("asymptote_generator_task_errors_total", {"reason": "no_sequence"}) == len(refused)
    train_ends = value("asymptote_generator_episodes_total", {"kind": "train", "reason": "env_raised"})
    assert train_ends == GROUP_SIZE * len(refused)
    assert value("asymptote_generator_episodes_total", {"kind": "eval", "reason": "env_raised"}) == 2 * num_heldout
    # The ledger: every refused train task dead-lettered; none lost, none twice.
    assert ledger.ok, ledger.as_dict()
    assert ledger.deadlettered == len(refused) and ledger.lost == [] and ledger.trained_twice == []


GATE_TIMEOUT_S = 300.0
"""The gated tool call's own timeout: far past the wait below, so that only a second task reaching the gate
while the first waits there can end that wait."""


async def test_a_task_waiting_on_its_environment_leaves_its_engine_place_to_another(
    nats: NatsServer, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One place in the engine (``max_inflight_groups`` 1) and tasks whose first tool call waits at a gate the
    test holds shut: while the first task's episodes wait on their environment, another task takes the
    engine and reaches the gate too (with the place held across the episode it would wait behind the first
    until its tool call timed out). Once the gate opens every task finishes, and the loop ends with no task
    parked."""
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))  # read by the environment workers the pool spawns
    rows = [{"id": f"q{i}", "prompt": f"Say {i} words.", "answer": "gate"} for i in range(10)]
    settings = multiturn_task(
        tmp_path, {}, rows, entry="tests.envs.tool_classes:Misbehaves", tool_timeout_s=GATE_TIMEOUT_S
    )
    h = harness(nats, settings, zero_variance="keep")
    tokenizer = AutoTokenizer.from_pretrained(str(engine.settings.model_dir))
    metrics = GeneratorMetrics()
    pool = EnvironmentPool(settings.environment)
    await pool.start()
    scorer = TaskScorer(settings, engine.settings.model_dir, metrics)
    arrived = Path(f"{gate}.arrived")

    async def two_tasks_at_gate() -> bool:
        return arrived.exists() and len(set(arrived.read_text().split())) >= 2

    try:
        async with running(h):
            eval_sub = await h.js.pull_subscribe(h.names.eval_results, durable="test", stream=h.names.evals_stream)
            runner = EpisodeRunner(engine, tokenizer, pool, settings.chat_template_kwargs)
            loop = rollout_loop(h, engine, metrics, scorer, runner, max_inflight_groups=1)
            async with looping(loop, eval_sub):
                await wait_until_async(two_tasks_at_gate, 120, "a second task at the gate")
                gate.touch()
                header, batch = await next_batch(h, timeout_s=120.0)
                results = await eval_results(eval_sub, len(DatasetTask(settings.dataset).problems("heldout")))
    finally:
        scorer.close()
        pool.close()
    # Every task that waited finished: a batch of train groups and the eval round, no episode timed out.
    assert header.num_groups == BATCH_PROMPTS and all(len(g.completions) == GROUP_SIZE for g in batch)
    assert all(r.num_samples == 2 for r in results)
    value = metrics.registry.get_sample_value
    assert not any(
        value("asymptote_generator_episodes_total", {"kind": k, "reason": "env_timeout"}) for k in ("train", "eval")
    )
    assert loop._parked == 0 and not loop._slots.locked()  # every place given back
