"""Multi-turn episodes on a real vLLM engine: the stored tokens are the engine's plus the template's.

One real ``AsyncLLM`` (the CPU build) per model, a tiny random Qwen3 and a
tiny random Llama, each with a locally trained BPE tokenizer and its
family's tool-calling chat template (tests/envs/chat_models.py), shaped so
that turns are a few tokens long, some ended by the model and some cut at
their token limit, and never hold special tokens (so a turn renders
verbatim, which the audit below relies on).

Many short episodes run at once against a deterministic environment (in
worker processes, answering alternately as a tool and as the user). Every
engine call is recorded, and each episode is audited against slow
references:

- token in: each turn's prompt, as the engine took it, is the stored
  sequence up to that turn;
- token out: the stored completion is the engine's turns (ids, log-probs,
  version spans, in the loss) with only the environment's tokens between
  them (log-prob 0, no span, out of the loss), and the masked count is the
  environment tokens the episode reports;
- re-render: each turn's prompt, decoded, is exactly the chat template's
  rendering of the conversation so far (the environment replayed in this
  process, the model's turns as sampled);
- the learner's own forward pass over the stored sequences gives the
  engine's log-probs on every token in the loss;
- each end reason follows from the limits.

A second test runs environments that fail in every way beside healthy
episodes on the same engine: each ends with its counted reason, the
others finish, and the generator's engine keeps serving.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from collections import Counter as Tally
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from asymptote.envs import EnvironmentPool, EnvironmentSettings, EnvTask, Message, parse_turn
from asymptote.sample import Sample
from services.generator.config import EngineSettings
from services.generator.engine import Engine
from services.generator.episode import Episode, EpisodeRunner
from services.learner.model import completion_logprobs, load_model, load_tokenizer, pack
from tests.envs.chat_models import Flavour, chat_model_dir
from tests.envs.tool_classes import ENVS_PYTHON, Counter

pytestmark = [pytest.mark.vllm]

NUM_EPISODES = int(os.environ.get("ASY_AUDIT_EPISODES", "40"))
"""Episodes audited per model: 40 in the suite; ``ASY_AUDIT_EPISODES=1000`` is the full audit (minutes)."""
SETTINGS = EnvironmentSettings(
    entry="tests.envs.tool_classes:Counter",
    max_turns=3,
    max_turn_tokens=10,
    cut_turn="continue",  # a cut turn goes on: the path whose tokens are the hardest to keep exact
    tool_timeout_s=30.0,
    num_workers=4,
)
BUDGET_TOKENS = {"qwen3": 84, "llama": 63}
"""max_episode_tokens: two answers (a tool result, then the user: 50 + 24 tokens in Qwen3's format,
27 + 26 in Llama's) and ten tokens, so that after two turns of at most ten tokens the third has room
or not by the turns' lengths: episodes end by the environment, at the third turn, and out of room."""
LOGPROB_TOL = 2e-3
"""vLLM's CPU float32 kernels against the learner's eager float32 forward (see test_architectures.py)."""

episode_id: contextvars.ContextVar[int] = contextvars.ContextVar("episode_id")


@dataclass(frozen=True)
class Call:
    prompt_ids: list[int]
    turn: Sample
    """What the engine sampled (a whole turn, or a part of one under length control)."""
    max_tokens: int = 0
    stop: tuple[str, ...] = ()


class RecordingEngine:
    """The engine, with every call (its prompt, token limit and stop strings) recorded under the episode
    that made it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.calls: dict[int, list[Call]] = {}

    async def sample(
        self,
        prompt: list[int],
        num_samples: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int = 0,
        stop: Sequence[str] = (),
    ) -> Any:
        assert num_samples == 1
        prompt_ids, samples = await self.engine.sample(
            prompt, num_samples, temperature, top_p, max_tokens, seed, stop=stop
        )
        assert prompt_ids == prompt  # token ids in are taken as they are
        self.calls.setdefault(episode_id.get(), []).append(Call(list(prompt), samples[0], max_tokens, tuple(stop)))
        return prompt_ids, samples


@pytest.fixture(scope="module", params=["qwen3", "llama"])
async def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, qwen3_chat_engine: tuple[Path, Engine]
) -> AsyncIterator[Any]:
    flavour: Flavour = request.param
    if flavour == "qwen3":  # the session's engine, shared with the multi-turn rollout's tests
        yield (flavour, *qwen3_chat_engine)
        return
    model_dir = chat_model_dir(flavour, tmp_path_factory.mktemp("episodes") / flavour)
    engine = Engine(
        EngineSettings(model_dir=model_dir, max_num_seqs=16, max_model_len=1024, kv_cache_memory_bytes=64 * 1024 * 1024)
    )
    await engine.start()
    try:
        yield flavour, model_dir, engine
    finally:
        await engine.shutdown()


async def run_episodes(runner: EpisodeRunner, tasks: list[EnvTask], first_seed: int = 101) -> dict[int, Episode]:
    async def one(i: int, task: EnvTask) -> tuple[int, Episode]:
        episode_id.set(i)
        return i, await runner.run(task, temperature=1.0, top_p=1.0, seed=first_seed + i)

    return dict(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))


async def conversation(
    tokenizer: Any, task: EnvTask, calls: list[Call]
) -> tuple[list[list[Message]], list[dict[str, Any]]]:
    """The messages before each turn and after the last one, with the environment run again in this
    process on the same turns and each model turn as sampled (its end token off); and the tools."""
    env = Counter()
    messages, tools = await env.reset(task)
    before = [messages]
    for call in calls:
        ids = call.turn.token_ids
        raw = tokenizer.decode(ids[:-1] if ids[-1] == tokenizer.eos_token_id else ids, skip_special_tokens=False)
        answer, _, _ = await env.step(call.turn.text)
        before.append([*before[-1], {"role": "assistant", "content": raw}, *answer])
    return before, tools


def render(tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]]) -> str:
    text: str = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return text


async def audit(
    tokenizer: Any, task: EnvTask, episode: Episode, calls: list[Call], rerender: bool = True
) -> Tally[str]:
    """Mismatches of ``episode`` against the slow references of the module docstring, by kind (``rerender``:
    with the re-render check, which replays the Counter environment here)."""
    wrong: Tally[str] = Tally()
    assert len(episode.samples) == 1 and episode.num_resplits == 0  # turns render verbatim: nothing re-renders
    (stored,) = episode.samples
    completion = stored.sample
    sequence = stored.prompt_ids + completion.token_ids
    n_prompt = len(stored.prompt_ids)
    mask = completion.loss_mask or [1] * len(completion.token_ids)
    expected_mask: list[int] = []
    expected_logprobs: list[float] = []
    expected_spans: list[tuple[int, int, int]] = []
    for call in calls:
        # Token in: the engine continued exactly the stored sequence so far.
        wrong["prompt"] += call.prompt_ids != sequence[: len(call.prompt_ids)]
        gap = len(call.prompt_ids) - n_prompt - len(expected_mask)  # the environment's tokens before this turn
        start = n_prompt + len(expected_mask) + gap
        expected_mask += [0] * gap + [1] * len(call.turn.token_ids)
        expected_logprobs += [0.0] * gap + call.turn.logprobs
        offset = start - n_prompt
        expected_spans += [(v, a + offset, b + offset) for v, a, b in call.turn.version_spans]
        # Token out: the turn's ids stand where the engine put them.
        wrong["turn_ids"] += sequence[start : start + len(call.turn.token_ids)] != call.turn.token_ids
    wrong["length"] += len(expected_mask) != len(completion.token_ids)
    wrong["mask"] += expected_mask != mask
    wrong["logprobs"] += expected_logprobs != completion.logprobs
    wrong["spans"] += expected_spans != completion.version_spans
    wrong["env_tokens"] += mask.count(0) != episode.num_env_tokens

    if not rerender:
        return wrong
    # Re-render: every turn's prompt is the template's own text for the conversation so far.
    before, tools = await conversation(tokenizer, task, calls)
    for call, messages in zip(calls, before):
        decoded = tokenizer.decode(call.prompt_ids, skip_special_tokens=False)
        wrong["rerender"] += decoded != render(tokenizer, messages, tools)
    return wrong


async def check_end(
    tokenizer: Any, settings: EnvironmentSettings, task: EnvTask, episode: Episode, calls: list[Call]
) -> None:
    """The end reason follows from the limits and the environment's schedule."""
    done_after = int(task.reference)
    assert episode.num_turns == len(calls)
    assert episode.final_turn == calls[-1].turn.text
    if episode.end_reason == "done":
        assert episode.num_turns == done_after and episode.reward == float(done_after)
        return
    assert episode.reward is None
    if episode.end_reason == "max_turns":
        assert episode.num_turns == settings.max_turns < done_after
        return
    assert episode.end_reason == "max_tokens"
    assert episode.num_turns < min(done_after, settings.max_turns)
    # No room for another turn: the stored tokens and the environment's answer, as the template renders it
    # after the stored text, reach the budget.
    (stored,) = episode.samples
    before, tools = await conversation(tokenizer, task, calls)
    stored_text = tokenizer.decode(stored.prompt_ids + stored.sample.token_ids, skip_special_tokens=False)
    following = render(tokenizer, before[-1], tools)
    assert following.startswith(stored_text)
    num_answer = len(tokenizer.encode(following[len(stored_text) :], add_special_tokens=False))
    assert len(stored.sample.token_ids) <= settings.max_episode_tokens <= len(stored.sample.token_ids) + num_answer


async def test_episodes_store_the_engines_tokens_and_only_the_templates_text_between(served: Any) -> None:
    flavour, model_dir, engine = served
    tokenizer = load_tokenizer(model_dir)
    recorder = RecordingEngine(engine)
    settings = SETTINGS.model_copy(update={"max_episode_tokens": BUDGET_TOKENS[flavour]})
    pool = EnvironmentPool(settings)
    await pool.start()
    try:
        runner = EpisodeRunner(cast(Engine, recorder), tokenizer, pool)
        tasks = [
            EnvTask(
                task_id=f"t{i}", prompt=f"Ada has {i} apples and buys {i + 3} more. How many?", reference=str(1 + i % 5)
            )
            for i in range(NUM_EPISODES)
        ]
        episodes = await run_episodes(runner, tasks)
    finally:
        pool.close()

    wrong: Tally[str] = Tally()
    for i, task in enumerate(tasks):
        wrong += await audit(tokenizer, task, episodes[i], recorder.calls[i])
        await check_end(tokenizer, settings, task, episodes[i], recorder.calls[i])
    turns = [c.turn for calls in recorder.calls.values() for c in calls]
    num_ended = sum(t.token_ids[-1] == tokenizer.eos_token_id for t in turns)
    num_env_tokens = sum(e.num_env_tokens for e in episodes.values())
    print(
        f"{model_dir.name}: {len(episodes)} episodes, {len(turns)} turns ({num_ended} ended by the model, "
        f"{len(turns) - num_ended} cut), {num_env_tokens} environment tokens; ends {dict(runner.ends)}; "
        f"mismatches {sum(wrong.values())}"
    )
    assert sum(wrong.values()) == 0, dict(wrong)
    assert runner.ends == Tally(e.end_reason for e in episodes.values())
    assert runner.num_resplits == 0
    # Every path was taken: turns ended and cut, and episodes ended by each limit and by the environment.
    assert 0 < num_ended < len(turns)
    assert set(runner.ends) == {"done", "max_turns", "max_tokens"}

    # The learner scores the stored sequences as the engine sampled them, on every token in the loss.
    model = load_model(model_dir)
    rows = [e.samples[0] for e in episodes.values()]
    batch = pack([r.prompt_ids for r in rows], [r.sample.token_ids for r in rows], int(tokenizer.pad_token_id))
    with torch.no_grad():
        logp = completion_logprobs(model, batch)
    gaps = [
        abs(float(logp[i, t]) - lp)
        for i, r in enumerate(rows)
        for t, (lp, m) in enumerate(zip(r.sample.logprobs, r.sample.loss_mask or [1] * len(r.sample.token_ids)))
        if m
    ]
    print(f"{model_dir.name}: learner vs engine log-probs over {len(gaps)} tokens: max gap {max(gaps):.2e}")
    assert max(gaps) <= LOGPROB_TOL


@pytest.mark.parametrize("served", ["qwen3"], indirect=True)
@pytest.mark.parametrize("library", ["openenv", "verifiers"])
async def test_environments_of_other_libraries_run_episodes_on_the_engine(served: Any, library: str) -> None:
    """Environments written against OpenEnv's and verifiers' public APIs (tests/envs/openenv_guess.py, the
    guessing game; tests/envs/verifiers_envs.py, the countdown), in workers on the environments' own
    interpreter, play episodes with the engine's turns: each ends as the game's rules say for the turns
    the model took, with the library's reward, and the stored tokens pass the audit's token checks (the
    re-render replays the environment, and this process has neither library: tests/envs/test_adapters.py
    checks their messages)."""
    from asymptote.envs.config import OpenEnvSettings

    _, model_dir, engine = served
    tokenizer = load_tokenizer(model_dir)
    recorder = RecordingEngine(engine)
    common = {"python": str(ENVS_PYTHON), "max_turns": 4, "max_episode_tokens": 400, "num_workers": 2}
    if library == "openenv":
        settings = SETTINGS.model_copy(
            update={
                **common,
                "entry": "tests.envs.openenv_guess:GuessEnvironment",
                "kind": "openenv",
                "openenv": OpenEnvSettings(action="tests.envs.openenv_guess:GuessAction", action_field="guess"),
            }
        )
        tasks = [EnvTask(task_id=f"g{i}", prompt="Find the secret number.", reference=str(i)) for i in range(6)]
        rules = guessing_game
    else:
        settings = SETTINGS.model_copy(
            update={**common, "entry": "tests.envs.verifiers_envs:Countdown", "kind": "verifiers"}
        )
        tasks = [EnvTask(task_id=f"c{i}", prompt="Say 3.") for i in range(6)]
        rules = countdown
    pool = EnvironmentPool(settings)
    await pool.start()
    try:
        runner = EpisodeRunner(cast(Engine, recorder), tokenizer, pool)
        episodes = await run_episodes(runner, tasks)
    finally:
        pool.close()
    wrong: Tally[str] = Tally()
    for i, task in enumerate(tasks):
        wrong += await audit(tokenizer, task, episodes[i], recorder.calls[i], rerender=False)
    assert sum(wrong.values()) == 0, dict(wrong)
    for i, task in enumerate(tasks):
        ending = (episodes[i].end_reason, episodes[i].reward, episodes[i].num_turns)
        assert ending == rules(task, recorder.calls[i]), (i, ending)
        assert episodes[i].num_env_tokens > 0


def countdown(task: EnvTask, calls: list[Call]) -> tuple[str, float, int]:
    """The countdown's end (tests/envs/verifiers_envs.py, slowly): three turns, told 3, 2 and 1; the reward
    is the share of turns whose text (outside any tool call, as the response's content) said so."""
    told = ["3", "2", "1"]
    said = [parse_turn(c.turn.text).content.strip() for c in calls]
    assert len(calls) == 3, f"the episode ended after {len(calls)} turns, not the countdown's three"
    return "done", sum(s == t for s, t in zip(said, told, strict=True)) / 3, 3


def guessing_game(task: EnvTask, calls: list[Call]) -> tuple[str, float, int]:
    """The game's end for the turns the model took (tests/envs/openenv_guess.py, slowly): a turn whose text
    after its reasoning is the secret wins at once; the third guess ends it otherwise."""
    for k, call in enumerate(calls, start=1):
        try:
            right = int(call.turn.text.rsplit("</think>", 1)[-1].strip()) == int(task.reference)
        except ValueError:  # not a number: the game says so
            right = False
        if right:
            return "done", 1.0, k
        if k == 3:
            return "done", 0.0, 3
    raise AssertionError(f"the episode ended after {len(calls)} turns, before the game did")


BUDGET = 6
"""The episode's thinking budget: one or two of the chat model's turns (a few tokens each, some run to it)."""


@pytest.mark.parametrize("served", ["qwen3"], indirect=True)
async def test_the_thinking_budget_is_spent_across_the_episode_s_turns(served: Any) -> None:
    """Length control in an episode, checked request by request against a slow replay of its rule: each
    turn runs to what is left of one budget (stopping at the thinking's end), one still thinking at the
    budget gets the phrase (out of the loss) and at most the answer budget, a turn that begins with the
    budget spent begins with the phrase; the thinking of all turns together stays within the budget."""
    from asymptote.tasks.length import LengthControlSettings
    from services.generator.length import LengthControl

    _, model_dir, engine = served
    tokenizer = load_tokenizer(model_dir)
    length = LengthControlSettings(
        thinking_budget_tokens=(BUDGET, BUDGET), answer_budget_tokens=4, interruption_phrase="Time is up."
    )
    phrase = tokenizer.encode(length.interruption_phrase, add_special_tokens=False)
    recorder = RecordingEngine(engine)
    settings = SETTINGS.model_copy(update={"max_episode_tokens": 300, "max_turn_tokens": 20})
    pool = EnvironmentPool(settings)
    await pool.start()
    try:
        runner = EpisodeRunner(cast(Engine, recorder), tokenizer, pool, length=LengthControl(length, phrase))
        tasks = [EnvTask(task_id=f"b{i}", prompt=f"Count {i}.", reference="3") for i in range(16)]
        episodes = await run_episodes(runner, tasks)
    finally:
        pool.close()

    paths: Tally[str] = Tally()
    for i in range(len(tasks)):
        (stored,) = episodes[i].samples
        requests = recorder.calls[i]
        left, k, num_turns, interrupted = BUDGET, 0, 0, False
        sequence = list(stored.prompt_ids)  # the episode's tokens so far, replayed from the requests
        mask: list[int] = []  # the completion's loss mask, replayed
        while k < len(requests):  # one turn: one or two requests
            first = requests[k]
            began_spent = left <= 0
            start = first.prompt_ids[: -len(phrase)] if began_spent else first.prompt_ids
            assert start[: len(sequence)] == sequence  # token in: the turn continues the episode
            mask += [0] * (len(start) - len(sequence))  # the environment's tokens before the turn
            if began_spent:  # the turn begins with the phrase and has the answer budget
                assert first.prompt_ids[-len(phrase) :] == phrase and first.stop == ()
                assert first.max_tokens <= length.answer_budget_tokens
                mask += [0] * len(phrase) + [1] * len(first.turn.token_ids)
                last, interrupted = first, True
                paths["began spent"] += 1
                k += 1
            else:
                assert first.stop == (length.think_end,) and first.max_tokens <= left
                left -= len(first.turn.token_ids)
                follow = requests[k + 1] if k + 1 < len(requests) else None
                if follow is not None and follow.prompt_ids == start + first.turn.token_ids + phrase:
                    assert first.turn.finish_reason == "length"
                    assert follow.max_tokens <= length.answer_budget_tokens
                    mask += [1] * len(first.turn.token_ids) + [0] * len(phrase) + [1] * len(follow.turn.token_ids)
                    last, interrupted = follow, True
                    paths["interrupted"] += 1
                    k += 2
                else:
                    mask += [1] * len(first.turn.token_ids)
                    last = first
                    paths["within budget"] += 1
                    k += 1
            sequence = last.prompt_ids + last.turn.token_ids
            num_turns += 1
        assert left >= 0  # every token sampled before the thinking closed counted: within the budget
        # Token out: the stored sample is the replayed sequence, the phrase and the environment out of the loss.
        assert stored.prompt_ids + stored.sample.token_ids == sequence
        assert (stored.sample.loss_mask or [1] * len(stored.sample.token_ids)) == mask
        assert stored.sample.interrupted == interrupted
        assert num_turns == episodes[i].num_turns
    print(f"thinking budget {BUDGET} over {len(tasks)} episodes: turns {dict(paths)}")
    assert set(paths) == {"within budget", "interrupted", "began spent"}, paths


MODES = ("raise", "garbage", "role", "oversize", "crash", "hang", "reset-hang")
"""tests.envs.tool_classes.Misbehaves: each fails its episode's first step (or reset) in its own way."""
REASONS = {
    "raise": "env_raised",
    "garbage": "env_invalid",
    "role": "env_invalid",
    "oversize": "env_oversize",
    "crash": "env_crashed",
    "hang": "env_timeout",
    "reset-hang": "env_timeout",
}


@pytest.mark.parametrize("served", ["qwen3"], indirect=True)
async def test_a_turn_cut_at_its_limit_ends_the_episode_by_default(served: Any) -> None:
    """With ``cut_turn: end`` (the default) an episode ends at its first turn cut at ``max_turn_tokens``:
    reason ``truncated``, no reward from the environment, nothing sampled after it, and that turn is the
    final one the verifier judges; episodes whose turns all ended go on as with ``continue``."""
    _, model_dir, engine = served
    tokenizer = load_tokenizer(model_dir)
    recorder = RecordingEngine(engine)
    settings = SETTINGS.model_copy(update={"cut_turn": "end", "max_turn_tokens": 20, "max_episode_tokens": 300})
    assert EnvironmentSettings(entry=settings.entry).cut_turn == "end"
    pool = EnvironmentPool(settings)
    await pool.start()
    try:
        runner = EpisodeRunner(cast(Engine, recorder), tokenizer, pool)
        tasks = [EnvTask(task_id=f"c{i}", prompt=f"Count to {i}.", reference=str(1 + i % 2)) for i in range(16)]
        episodes = await run_episodes(runner, tasks)
    finally:
        pool.close()

    for i, episode in episodes.items():
        calls = recorder.calls[i]
        assert episode.num_turns == len(calls) and episode.final_turn == calls[-1].turn.text
        cut = [k for k, c in enumerate(calls) if c.turn.finish_reason == "length"]
        if cut:
            assert cut == [len(calls) - 1], "a turn was sampled after a cut one"
            assert calls[-1].max_tokens == settings.max_turn_tokens
            assert (episode.end_reason, episode.reward) == ("truncated", None)
        else:
            # Counter ends the episode after ``reference`` turns, with the number of turns as its reward.
            turns = int(tasks[i].reference)
            assert (episode.end_reason, episode.reward, len(calls)) == ("done", float(turns), turns)
    assert set(runner.ends) == {"truncated", "done"}


async def test_failing_environments_end_their_own_episodes_only(served: Any) -> None:
    _, model_dir, engine = served
    tokenizer = load_tokenizer(model_dir)
    settings = SETTINGS.model_copy(
        update={"entry": "tests.envs.tool_classes:Misbehaves", "tool_timeout_s": 2.0, "max_observation_bytes": 4096}
    )
    pool = EnvironmentPool(settings)
    await pool.start()
    try:
        runner = EpisodeRunner(engine, tokenizer, pool)
        tasks = [EnvTask(task_id=m, prompt="Count.", reference=m) for m in MODES]
        tasks += [EnvTask(task_id=f"well{i}", prompt="Count.", reference="well") for i in range(6)]
        episodes = await asyncio.gather(*(runner.run(t, 1.0, 1.0, seed=7 + i) for i, t in enumerate(tasks)))
        after = await runner.run(EnvTask(prompt="Count.", reference="well"), 1.0, 1.0, seed=3)
    finally:
        pool.close()

    for task, episode in zip(tasks, episodes):
        if task.reference == "well":
            assert (episode.end_reason, episode.reward, episode.num_turns) == ("done", 2.0, 2)
            continue
        assert episode.end_reason == REASONS[task.reference], (task.reference, episode)
        assert episode.reward is None and episode.error
        # What the model sampled before the failure is kept (its one turn); a reset that hung sampled nothing.
        assert episode.num_turns == (0 if task.reference == "reset-hang" else 1)
        assert len(episode.samples) == episode.num_turns
    assert after.end_reason == "done"
    assert runner.ends == Tally(
        {"done": 7, "env_invalid": 2, "env_timeout": 2, "env_raised": 1, "env_oversize": 1, "env_crashed": 1}
    )


class SwappingEngine:
    """The engine; once the first turn returns, it loads ``folder`` as the next version before answering,
    so the episode's next turn is sampled under it: a swap forced between two turns."""

    def __init__(self, engine: Engine, folder: Path) -> None:
        self.engine = engine
        self.folder = folder
        self.swapped_to: int | None = None

    async def sample(self, *args: Any, **kwargs: Any) -> Any:
        out = await self.engine.sample(*args, **kwargs)
        if self.swapped_to is None:
            self.swapped_to = self.engine.version + 1
            await self.engine.swap(self.folder, self.swapped_to, "inflight")
        return out


@pytest.mark.parametrize("served", ["llama"], indirect=True)  # an engine of this module's own, swapped here
async def test_a_swap_between_turns_gives_the_episode_two_versions_and_the_gate_its_oldest(
    served: Any, tmp_path: Path
) -> None:
    """The version-1 weights are version 0's own bytes: what is checked is the bookkeeping of versions
    (the numerics of a swap under way: test_swap.py, test_architectures.py)."""
    from safetensors.torch import load_file

    from asymptote.codec import DecodedWeights, version_digest
    from asymptote.contracts.v1 import rollout_pb2
    from services.broker.batcher import Batcher
    from services.generator.rollout import episode_completions
    from services.generator.weights import stage
    from services.learner.weights import to_wire
    from tests.generator.test_multiturn_group import offline_loop

    _, model_dir, engine = served
    tokenizer = load_tokenizer(model_dir)
    tensors = {n: to_wire(t) for f in sorted(model_dir.glob("*.safetensors")) for n, t in load_file(str(f)).items()}
    folder = stage(DecodedWeights(1, version_digest(tensors), tensors), tmp_path / "staged", model_dir)
    swapping = SwappingEngine(engine, folder)
    before = engine.version
    pool = EnvironmentPool(SETTINGS.model_copy(update={"max_episode_tokens": 400}))
    await pool.start()
    try:
        runner = EpisodeRunner(cast(Engine, swapping), tokenizer, pool)
        episode = await runner.run(EnvTask(task_id="swap", prompt="Count.", reference="2"), 1.0, 1.0, seed=11)
    finally:
        pool.close()

    assert swapping.swapped_to == before + 1 == engine.version
    assert (episode.end_reason, episode.num_turns, len(episode.samples)) == ("done", 2, 1)
    (stored,) = episode.samples
    spans = stored.sample.version_spans
    # The first turn's tokens under the old version, the second's under the new; the environment's in between
    # under none (out of the loss).
    assert [v for v, _, _ in spans] == [before, before + 1], spans
    mask = stored.sample.loss_mask
    assert all(mask[i] for v, a, b in spans for i in range(a, b)) and mask.count(0) == episode.num_env_tokens > 0

    loop = offline_loop(engine)
    prompt_ids, completions = episode_completions([episode], [2.0])
    task = rollout_pb2.GenerationTask(task_id="swap", prompt="Count.")
    group = loop._group(task, prompt_ids, completions, [stored.sample], started=0.0)
    assert (group.min_version, group.max_version) == (before, before + 1)
    # The staleness gate reads the oldest version in the trajectory: with k = 2 the group is admitted while
    # the learner is at most 2 versions past the first turn's, not 3.
    batcher = Batcher(batch_prompts=1, max_staleness_versions=2)
    assert not batcher.is_stale(group, learner_version=before + 2)
    assert batcher.is_stale(group, learner_version=before + 3)
