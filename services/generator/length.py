"""Interruption length control: a thinking budget, the interruption phrase, an answer budget.

Owns carrying out ScaleRL's length control for one prompt group
(settings and the budget draw: asymptote/tasks/length.py; the continuation
and splice rules, shared with the single-process loop: asymptote/sample.py). The group's G
completions first run to the group's thinking budget, stopping early at
the text that closes thinking. Then each completion that

- reached the budget still thinking gets the interruption phrase's tokens
  appended and continues for at most the answer budget (interrupted);
- closed its thinking continues for at most the answer budget;
- ended by itself (end of sequence) is done.

In a multi-turn episode the budget is the episode's: each turn runs to
what is left of it (``LengthControl.sample_turn``), so the thinking of all
the model's turns together stays within one drawn budget.

A continuation is a new engine request whose prompt is the prompt, the
first part and the phrase, so the prefix cache serves what the first
request computed. The spliced completion keeps every sampled token's
log-prob and policy-version span (a swap between the two requests shows
as two versions); the phrase's tokens have log-prob 0, no span, and 0 in
the loss mask. The task's max_tokens still caps the whole completion.
Knows nothing about NATS or rewards.
"""

from __future__ import annotations

import asyncio

from asymptote.sample import Sample, continuation, splice
from asymptote.tasks.length import LengthControlSettings, draw_thinking_budget
from services.generator.engine import Engine


class LengthControl:
    """Samples prompt groups under a thinking budget drawn per group (see the module docstring)."""

    def __init__(self, settings: LengthControlSettings, phrase_ids: list[int]) -> None:
        if not settings.enabled:
            raise ValueError("LengthControl needs thinking_budget_tokens")
        if not phrase_ids:
            raise ValueError(f"the interruption phrase {settings.interruption_phrase!r} tokenizes to no tokens")
        self.settings = settings
        self.phrase_ids = phrase_ids

    async def sample(
        self,
        engine: Engine,
        task_id: str,
        prompt: str,
        num_samples: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int = 0,
    ) -> tuple[list[int], list[Sample]]:
        """(prompt ids, completions) of one group; see the module docstring."""
        s = self.settings
        budget = draw_thinking_budget(s, task_id)
        prompt_ids, firsts = await engine.sample(
            prompt, num_samples, temperature, top_p, min(budget, max_tokens), seed, stop=[s.think_end]
        )

        # Each continuation is its own request: distinct seeds keep seeded groups diverse.
        samples = await asyncio.gather(
            *(
                self._finish(engine, prompt_ids, first, temperature, top_p, max_tokens, seed + 1 + i if seed else 0)
                for i, first in enumerate(firsts)
            )
        )
        return prompt_ids, list(samples)

    async def _finish(
        self,
        engine: Engine,
        prompt_ids: list[int],
        first: Sample,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int,
    ) -> Sample:
        """``first`` (a first part, run to the budget) as it goes on (``continuation``): itself when it is
        done, else spliced with a continuation request sampled with ``seed``."""
        follow = continuation(first, self.settings, self.phrase_ids, max_tokens)
        if follow is None:
            return first
        _, (second,) = await engine.sample(
            prompt_ids + first.token_ids + follow.injected_ids, 1, temperature, top_p, follow.max_tokens, seed
        )
        text = self.settings.interruption_phrase if follow.injected_ids else ""
        return splice(first, follow.injected_ids, text, second)

    async def sample_turn(
        self,
        engine: Engine,
        prompt_ids: list[int],
        budget_left: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int = 0,
    ) -> tuple[Sample, int]:
        """One turn of a multi-turn episode under what is left of the episode's thinking budget: (the turn,
        the budget it used).

        As a group's completion is sampled, with the budget left in place of
        the whole budget: the turn runs to it (or its ``max_tokens``),
        stopping where it closes its thinking; still thinking at the budget,
        it gets the phrase and at most the answer budget more. Every token
        before the turn's thinking closed counts against the budget. A turn
        that begins with the budget spent begins with the phrase.
        """
        s = self.settings
        if budget_left <= 0:
            room = min(s.answer_budget_tokens, max_tokens - len(self.phrase_ids))
            if room <= 0:  # no room for the phrase: the turn is what fits
                _, (turn,) = await engine.sample(prompt_ids, 1, temperature, top_p, max_tokens, seed)
                return turn, 0
            _, (second,) = await engine.sample(prompt_ids + self.phrase_ids, 1, temperature, top_p, room, seed)
            return splice(_NOTHING, self.phrase_ids, s.interruption_phrase, second), 0
        _, (first,) = await engine.sample(
            prompt_ids, 1, temperature, top_p, min(budget_left, max_tokens), seed, stop=[s.think_end]
        )
        turn = await self._finish(engine, prompt_ids, first, temperature, top_p, max_tokens, seed + 1 if seed else 0)
        return turn, len(first.token_ids)


_NOTHING = Sample(token_ids=[], logprobs=[], version_spans=[], finish_reason="length", text="")
"""An empty first part: what a turn that begins with the phrase has before it."""
