"""A sampled completion, and the rules of interruption length control over one (ScaleRL), torch-free.

Owns what an engine's completion carries (``Sample``: tokens, sampling
log-probs, the policy versions that sampled them, what ended it) and the two
rules a length-controlled completion follows whatever samples it: how a first
part run to its thinking budget goes on (``continuation``) and how the parts
join, with what was injected between them out of the loss (``splice``). The
generator carries them out with vLLM (services/generator/length.py), the
single-process loop with the transformers model (services/embedded/sampling.py);
the settings and the budget draw are asymptote/tasks/length.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asymptote.tasks.length import LengthControlSettings


@dataclass(frozen=True)
class Sample:
    """One completion as the engine produced it."""

    token_ids: list[int]
    logprobs: list[float]
    version_spans: list[tuple[int, int, int]]  # (version, start, end)
    finish_reason: str
    text: str
    stop_reason: str | None = None
    """The stop string that ended it, if one did."""
    loss_mask: list[int] = field(default_factory=list)
    """0 on tokens the generator injected (out of the loss); empty: every token is in the loss."""
    interrupted: bool = False
    """The interruption phrase was appended (its thinking budget ran out)."""
    num_cached_tokens: int = 0
    """Prompt tokens of its (last) request served from the prefix cache."""
    routing: bytes | None = None
    """An MoE model with routing replay: the experts each token was routed to (``asymptote.routing``'s rows,
    the engine's layout), its prompt's tokens then its own but the last; None: not recorded."""

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def splice(
    first: Sample, injected_ids: list[int], injected_text: str, second: Sample, *, interruption: bool = True
) -> Sample:
    """``first``, then the injected tokens (out of the loss), then ``second``, as one completion.

    ``second``'s version spans are moved past the first part and the
    injected tokens; the injected tokens get log-prob 0 and no span.
    ``interruption``: the injected tokens are the interruption phrase (the
    completion is marked interrupted); False for other text, such as an
    environment's answer between two turns of an episode.
    """
    offset = len(first.token_ids) + len(injected_ids)
    spans = list(first.version_spans) + [(v, a + offset, b + offset) for v, a, b in second.version_spans]
    first_mask = first.loss_mask or [1] * len(first.token_ids)
    mask = first_mask + [0] * len(injected_ids) + (second.loss_mask or [1] * len(second.token_ids))
    return Sample(
        token_ids=first.token_ids + injected_ids + second.token_ids,
        logprobs=first.logprobs + [0.0] * len(injected_ids) + second.logprobs,
        version_spans=spans,
        finish_reason=second.finish_reason,
        text=first.text + injected_text + second.text,
        stop_reason=second.stop_reason,
        loss_mask=mask if 0 in mask else [],
        interrupted=first.interrupted or second.interrupted or (interruption and bool(injected_ids)),
        num_cached_tokens=second.num_cached_tokens,
    )


@dataclass(frozen=True)
class Continuation:
    """What follows a first part: the tokens to inject (none when thinking closed) and the room left."""

    injected_ids: list[int]
    max_tokens: int


def continuation(
    first: Sample, settings: LengthControlSettings, phrase_ids: list[int], max_tokens: int
) -> Continuation | None:
    """How ``first`` (a first part, run to the thinking budget) goes on, or None when it is done.

    Done: it ended by itself, or the task's ``max_tokens`` leaves no room
    after it (and the phrase): it then stays as it is, truncated.
    """
    closed = settings.think_end in first.text
    if not closed and first.finish_reason != "length":
        return None  # ended by itself while thinking
    if closed and first.stop_reason != settings.think_end:
        return None  # closed its thinking and went on to end by itself (or at the cap)
    injected = [] if closed else phrase_ids
    room = min(settings.answer_budget_tokens, max_tokens - len(first.token_ids) - len(injected))
    return Continuation(injected, room) if room > 0 else None
