"""Multi-turn episodes: the engine's turns and an environment's answers as token-exact training samples.

Owns running one episode of a task against an environment (leased from an
``asymptote.envs.pool.EnvironmentPool``) beside this generator's engine.
The environment's first messages and tools are rendered by the model's
chat template into the prompt's tokens; then, turn by turn, the engine
samples the model's turn from the token ids so far (token in), the
environment answers the turn's text, and only the template's difference
for its answer is tokenised (``asymptote.envs.transcript``) and appended
with loss mask 0, log-prob 0 and no version span. The model's tokens,
log-probs and version spans are kept exactly as the engine produced them
(token out), spliced as length control splices its phrase (length.py).
Under length control the thinking budget is the episode's, drawn once by
task id and spent across its turns (``LengthControl.sample_turn``).

A training sample is the prompt's ids and the spliced completion. When
the template cannot extend the history without re-rendering earlier text,
the sample so far is closed and a new one starts from the full rendering
(counted in ``num_resplits``).

Every episode ends with one counted reason: ``done`` (the environment
said so), ``max_turns``, ``max_tokens`` (no room left for a turn under
``max_episode_tokens``, or a turn cut by it), ``truncated`` (a turn cut at
``max_turn_tokens``, with ``cut_turn: end``, the default), or
``env_<reason>`` for an environment that failed (timed out, raised,
returned what the interface does not allow or what the chat template
refuses, sent an oversize observation, or crashed its worker): such an episode keeps the samples it had and no reward, and
the generator goes on. Each episode also counts the tool calls its turns
made (Hermes ``<tool_call>`` blocks that parse), the tool errors (calls
that do not parse, and tool messages that report a failed call in the
tool-class format, ``asymptote.envs.tools.TOOL_ERROR``) and the time its
environment took. Errors of the engine itself propagate (the task is
handed back, as for single-turn groups). Knows nothing about NATS or verifiers.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from asymptote.envs.base import EnvTask
from asymptote.envs.config import EnvironmentSettings
from asymptote.envs.pool import FAILURE_REASONS, EnvFailure, EnvironmentPool, EnvSession
from asymptote.envs.tools import TOOL_ERROR, parse_turn
from asymptote.envs.transcript import ChatTokenizer, Transcript, check_chat_tokenizer
from asymptote.sample import Sample, splice
from asymptote.tasks.length import draw_thinking_budget
from services.generator.engine import Engine
from services.generator.length import LengthControl

log = logging.getLogger(__name__)

END_REASONS = ("done", "max_turns", "max_tokens", "truncated", *(f"env_{r}" for r in FAILURE_REASONS))
"""Why an episode ended (``env_*``: the environment failed)."""


@dataclass(frozen=True)
class TrainingSample:
    """One sequence for the learner: its prompt's ids and its completion (the environment's tokens masked)."""

    prompt_ids: list[int]
    sample: Sample


@dataclass(frozen=True)
class Episode:
    samples: list[TrainingSample]
    """In order; more than one when the template re-rendered earlier text."""
    end_reason: str
    """One of END_REASONS."""
    reward: float | None
    """The environment's reward (None: none given, or the environment failed)."""
    num_turns: int
    """Model turns sampled."""
    final_turn: str
    """The text of the model's last turn (what a verifier scores when the environment gives no reward)."""
    num_env_tokens: int = 0
    """Environment tokens inserted into the samples (all of them loss mask 0)."""
    num_resplits: int = 0
    """Times a new training sample was started because the template re-rendered earlier text."""
    error: str = ""
    """The environment's failure, for ``env_*`` reasons."""
    num_tool_calls: int = 0
    """Tool calls the model's turns made (that parse)."""
    num_tool_errors: int = 0
    """Malformed tool calls, and tool results that report a failed call."""
    env_s: float = 0.0
    """Time spent waiting for the environment (reset and every step)."""


@dataclass
class _Stream:
    """The training sample under way: prompt, model turns so far, and the environment's tokens to follow."""

    prompt_ids: list[int]
    completion: Sample | None = None
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""

    def ids(self) -> list[int]:
        done = self.completion.token_ids if self.completion is not None else []
        return self.prompt_ids + done + self.pending_ids

    def add_turn(self, turn: Sample) -> int:
        """Append the engine's ``turn`` after the pending environment tokens; returns how many those were."""
        inserted = len(self.pending_ids)
        if self.completion is None:
            self.completion = turn
        else:
            self.completion = splice(self.completion, self.pending_ids, self.pending_text, turn, interruption=False)
        self.pending_ids, self.pending_text = [], ""
        return inserted


class EpisodeRunner:
    """Runs episodes against one environment (see the module docstring); counts their ends.

    ValueError for a tokenizer that cannot render episodes (no chat template or end token), so that a
    generator stops at start rather than failing every episode.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: ChatTokenizer,
        pool: EnvironmentPool,
        template_kwargs: dict[str, Any] | None = None,
        length: LengthControl | None = None,
    ) -> None:
        check_chat_tokenizer(tokenizer)
        self.engine = engine
        self.length = length
        """Length control: one thinking budget per episode (drawn by task id), across its turns."""
        self.tokenizer = tokenizer
        self.pool = pool
        self.settings: EnvironmentSettings = pool.settings
        self.template_kwargs = template_kwargs or {}
        self.ends: Counter[str] = Counter()
        """Episodes ended, by reason."""
        self.num_resplits = 0
        """Training samples started anew because the template re-rendered earlier text, over all episodes."""

    async def run(
        self,
        task: EnvTask,
        temperature: float,
        top_p: float,
        seed: int = 0,
        place: contextlib.AbstractAsyncContextManager[Any] | None = None,
    ) -> Episode:
        """One episode of ``task``; see the module docstring. ``place``, if given, is entered around each
        turn's engine call (the task's place in the engine, held only while it samples)."""
        record = _Record()
        try:
            async with self.pool.episode() as env:
                await self._play(env, task, temperature, top_p, seed, record, place or contextlib.nullcontext())
        except EnvFailure as exc:
            record.end(f"env_{exc.reason}", error=exc.detail)
            log.warning("episode of task %s ended: %s", task.task_id, exc)
        self.ends[record.end_reason] += 1
        self.num_resplits += record.num_resplits
        return record.episode()

    async def _play(
        self,
        env: EnvSession,
        task: EnvTask,
        temperature: float,
        top_p: float,
        seed: int,
        record: _Record,
        place: contextlib.AbstractAsyncContextManager[Any],
    ) -> None:
        s = self.settings
        began = time.perf_counter()
        try:
            messages, tools = await env.reset(task)
        finally:
            record.env_s += time.perf_counter() - began
        with _template_checked():
            transcript = Transcript(self.tokenizer, messages, tools, self.template_kwargs)
            stream = _Stream(transcript.prompt_ids())
        first_prompt = len(stream.prompt_ids)
        record.streams.append(stream)
        length = self.length
        budget_left = draw_thinking_budget(length.settings, task.task_id) if length is not None else 0
        for turn in range(s.max_turns):
            ids = stream.ids()
            room = s.max_episode_tokens - (len(ids) - first_prompt)
            if room <= 0:
                record.end("max_tokens")
                return
            # Each turn is its own request: distinct seeds keep a seeded episode's turns apart.
            turn_seed = seed + turn if seed else 0
            async with place:
                if length is None:
                    _, (sampled,) = await self.engine.sample(
                        ids, 1, temperature, top_p, min(s.max_turn_tokens, room), turn_seed
                    )
                else:
                    sampled, used = await length.sample_turn(
                        self.engine, ids, budget_left, temperature, top_p, min(s.max_turn_tokens, room), turn_seed
                    )
                    budget_left -= used
            record.num_env_tokens += stream.add_turn(sampled)
            record.num_turns += 1
            record.final_turn = sampled.text
            parsed = parse_turn(sampled.text)
            record.num_tool_calls += len(parsed.calls)
            record.num_tool_errors += len(parsed.errors)
            if sampled.truncated and s.cut_turn == "end":
                record.end("truncated" if s.max_turn_tokens <= room else "max_tokens")
                return
            began = time.perf_counter()
            try:
                result = await env.step(sampled.text)
            finally:
                record.env_s += time.perf_counter() - began
            # A malformed call's own error message is counted once, as the parse error above.
            record.num_tool_errors += sum(
                m["role"] == "tool" and m["content"].startswith(TOOL_ERROR) and m.get("name") != "error"
                for m in result.observation
            )
            if result.done:
                record.end("done", reward=result.reward)
                return
            if turn == s.max_turns - 1:
                break
            with _template_checked():
                extension = transcript.extend(sampled.token_ids, result.observation)
                if extension is None:
                    record.num_resplits += 1
                    stream = _Stream(transcript.prompt_ids())
                    record.streams.append(stream)
                else:
                    stream.pending_ids, stream.pending_text = extension.ids, extension.text
        record.end("max_turns")


@contextlib.contextmanager
def _template_checked() -> Iterator[None]:
    """EnvFailure ``invalid`` when the chat template refuses what the environment sent."""
    try:
        yield
    except (TemplateError, TypeError, ValueError, KeyError) as exc:
        raise EnvFailure("invalid", f"the chat template refused the environment's messages: {exc}") from exc


@dataclass
class _Record:
    """What an episode has produced so far (kept when it ends early)."""

    streams: list[_Stream] = field(default_factory=list)
    end_reason: str = ""
    reward: float | None = None
    error: str = ""
    num_turns: int = 0
    num_env_tokens: int = 0
    num_resplits: int = 0
    final_turn: str = ""
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    env_s: float = 0.0

    def end(self, reason: str, reward: float | None = None, error: str = "") -> None:
        assert reason in END_REASONS, reason
        self.end_reason, self.reward, self.error = reason, reward, error

    def episode(self) -> Episode:
        samples = [TrainingSample(s.prompt_ids, s.completion) for s in self.streams if s.completion is not None]
        return Episode(
            samples=samples,
            end_reason=self.end_reason,
            reward=self.reward,
            num_turns=self.num_turns,
            final_turn=self.final_turn,
            num_env_tokens=self.num_env_tokens,
            num_resplits=self.num_resplits,
            error=self.error,
            num_tool_calls=self.num_tool_calls,
            num_tool_errors=self.num_tool_errors,
            env_s=self.env_s,
        )
