"""Prompt groups sampled with the transformers model under a task's length control.

The single-process loop's counterpart of what a generator does with vLLM
(services/generator/length.py), carried out by the same rules (asymptote/sample.py): each group's
thinking budget drawn from its key (``draw_thinking_budget``), a first part
run to that budget and stopped where the thinking closes, then
``continuation`` (the interruption phrase, out of the loss, for a
completion still thinking; the answer budget for every one that goes on)
and ``splice``. Each part is one batched, KV-cached ``sample`` over every
row at once, so a step costs two passes of the batch, not one per group.
Without length control it is plain ``sample`` to the task's ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asymptote.sample import Sample, continuation, splice
from asymptote.tasks import DatasetSettings, Task
from asymptote.tasks.length import LengthControlSettings, draw_thinking_budget
from services.learner.model import Samples, sample


@dataclass(frozen=True)
class GroupSamples:
    """One completion per row, with what length control added."""

    samples: Samples
    """Token ids, sampling log-probs (0 on injected tokens) and truncation of every completion."""
    loss_masks: list[list[int]]
    """Per completion token: 1 sampled, 0 injected (the interruption phrase)."""
    interrupted: list[bool]
    """The interruption phrase was appended (the thinking budget ran out)."""


def length_control_of(task: Task) -> LengthControlSettings | None:
    """A dataset task's length control when it is on, else None (the tasks a generator samples plainly)."""
    settings = getattr(task, "settings", None)
    if isinstance(settings, DatasetSettings) and settings.length_control.enabled:
        return settings.length_control
    return None


def think_end_id(tokenizer: PreTrainedTokenizerBase, think_end: str) -> int:
    """The token id of ``think_end``; ValueError unless it is one token (as ``</think>`` is for Qwen3 and the
    project's tokenizers), since a first part is stopped on that token."""
    ids = tokenizer.encode(think_end, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"length control's think_end {think_end!r} is {len(ids)} tokens of this tokenizer: the single-process "
            "sampler stops on one token"
        )
    return int(ids[0])


def sample_groups(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    keys: Sequence[str],
    max_tokens: int,
    length: LengthControlSettings | None,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> GroupSamples:
    """One completion of every row of ``prompts``; rows with the same key are one group (one budget)."""
    if len(keys) != len(prompts):
        raise ValueError(f"need one key per prompt row, got {len(keys)} keys for {len(prompts)} rows")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if length is None or not length.enabled:
        plain = sample(model, prompts, max_tokens, eos, pad, temperature, generator)
        return GroupSamples(plain, [[1] * len(c) for c in plain.completions], [False] * len(prompts))
    stop = think_end_id(tokenizer, length.think_end)
    phrase_ids = tokenizer.encode(length.interruption_phrase, add_special_tokens=False)
    budgets = {key: draw_thinking_budget(length, key) for key in set(keys)}
    first = sample(
        model, prompts, [min(budgets[k], max_tokens) for k in keys], eos, pad, temperature, generator, stop_ids=[stop]
    )
    parts = [
        _part(tokenizer, ids, logps, cut, length.think_end if ids and ids[-1] == stop else None)
        for ids, logps, cut in zip(first.completions, first.logprobs, first.truncated)
    ]
    todo = [
        (i, f) for i, f in enumerate(continuation(p, length, phrase_ids, max_tokens) for p in parts) if f is not None
    ]
    if todo:
        rows = [prompts[i] + parts[i].token_ids + f.injected_ids for i, f in todo]
        second = sample(model, rows, [f.max_tokens for _, f in todo], eos, pad, temperature, generator)
        for j, (i, f) in enumerate(todo):
            more = _part(tokenizer, second.completions[j], second.logprobs[j], second.truncated[j], None)
            parts[i] = splice(parts[i], f.injected_ids, length.interruption_phrase if f.injected_ids else "", more)
    return GroupSamples(
        Samples(
            completions=[p.token_ids for p in parts],
            logprobs=[p.logprobs for p in parts],
            truncated=[p.truncated for p in parts],
        ),
        [p.loss_mask or [1] * len(p.token_ids) for p in parts],
        [p.interrupted for p in parts],
    )


def _part(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], logprobs: list[float], cut: bool, stop_reason: str | None
) -> Sample:
    """A sampled part as the engine reports one (its text as vLLM detokenizes it, special tokens skipped)."""
    return Sample(
        token_ids=ids,
        logprobs=logprobs,
        version_spans=[],
        finish_reason="length" if cut else "stop",
        text=str(tokenizer.decode(ids, skip_special_tokens=True)),
        stop_reason=stop_reason,
    )
