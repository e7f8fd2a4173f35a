"""What an episode counts: tool calls, tool errors and the environment's time, over scripted model turns.

The engine is a stand-in that answers each turn with a scripted text (its
tokens from the test tokenizer, with the end token): the counts depend
only on the turns, which a random model would not write. The environment
is the ``Calculator`` tool class, in worker processes as a generator runs
it. Turns and what each must count:

1. ``add`` called well, and ``divide`` by zero (the tool raises: its
   result reports the error): 2 calls, 1 error;
2. a call of a tool that does not exist (an error result) and a call
   whose JSON is malformed (a parse error; its error result is not counted
   twice): 1 call, 2 errors;
3. the answer, with no call: the episode is done with Calculator's reward.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from asymptote.envs import EnvironmentPool, EnvironmentSettings, EnvTask
from asymptote.sample import Sample
from services.generator.episode import EpisodeRunner
from tests.envs.chat_models import chat_tokenizer

TURNS = [
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>',
    '<tool_call>{"name": "power", "arguments": {"a": 2}}</tool_call><tool_call>{"name": "add", </tool_call>',
    "The answer is 5.",
]


class ScriptedEngine:
    """Answers the n-th request with the n-th scripted turn, all of it in the loss at version 0."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.num_calls = 0

    async def sample(self, prompt: list[int], num_samples: int, *args: Any, **kwargs: Any) -> Any:
        text = TURNS[self.num_calls]
        self.num_calls += 1
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return prompt, [Sample(ids, [-0.5] * len(ids), [(0, 0, len(ids))], "stop", text)]


async def test_an_episode_counts_its_tool_calls_errors_and_environment_time(tmp_path: Path) -> None:
    tokenizer = chat_tokenizer("qwen3")
    settings = EnvironmentSettings(
        entry="tests.envs.tool_classes:Calculator", kind="tools", max_turns=4, max_episode_tokens=4000, num_workers=1
    )
    pool = EnvironmentPool(settings)
    await pool.start()
    try:
        engine = ScriptedEngine(tokenizer)
        runner = EpisodeRunner(engine, tokenizer, pool)  # type: ignore[arg-type]
        began = time.perf_counter()
        episode = await runner.run(EnvTask(task_id="t", prompt="What is 2 + 3?", reference="5"), 1.0, 1.0)
        elapsed = time.perf_counter() - began
    finally:
        pool.close()
    assert (episode.end_reason, episode.reward, episode.num_turns) == ("done", 1.0, 3)
    assert (episode.num_tool_calls, episode.num_tool_errors) == (3, 3)
    # The environment's time is within the episode's, and not nothing (three steps and a reset in a worker).
    assert 0 < episode.env_s <= elapsed


def test_a_tokenizer_without_a_chat_template_is_refused_before_any_episode() -> None:
    tokenizer = chat_tokenizer("qwen3")
    tokenizer.chat_template = None
    pool = EnvironmentPool(EnvironmentSettings(entry="tests.envs.tool_classes:Calculator", kind="tools"))
    with pytest.raises(ValueError, match="need a tokenizer with a chat_template"):
        EpisodeRunner(ScriptedEngine(tokenizer), tokenizer, pool)  # type: ignore[arg-type]
