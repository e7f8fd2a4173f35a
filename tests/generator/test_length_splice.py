"""Interruption length control without an engine: the budget draw, what follows a first part, and how
the parts are spliced into one completion whose loss mask and version spans reach the learner intact.

The engine-backed path (a real vLLM engine interrupting a tiny model) is in test_length_control.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from asymptote.contracts.v1 import rollout_pb2
from asymptote.errors import PayloadError
from asymptote.messages import validate_group
from asymptote.sample import Continuation, Sample, continuation, splice
from asymptote.tasks import LengthControlSettings
from asymptote.tasks.length import SCALERL_PHRASE, draw_thinking_budget
from services.generator.rollout import completion

ON = LengthControlSettings(thinking_budget_tokens=(5, 8), answer_budget_tokens=6)
PHRASE_IDS = [90, 91, 92]


def test_budget_draw_is_seeded_per_task_and_covers_the_range() -> None:
    budgets = [draw_thinking_budget(ON, f"t-{i}") for i in range(2000)]
    counts = Counter(budgets)
    assert set(counts) == {5, 6, 7, 8}  # both ends included
    # Uniform: each of the 4 values near 500 (a fixed draw: same ids, same seed, same counts every run).
    assert all(400 <= n <= 600 for n in counts.values()), counts
    # A redelivered task draws the same budget; another seed draws another sequence.
    assert budgets == [draw_thinking_budget(ON, f"t-{i}") for i in range(2000)]
    other = [draw_thinking_budget(ON.model_copy(update={"seed": 1}), f"t-{i}") for i in range(2000)]
    assert sum(a != b for a, b in zip(budgets, other)) > 1000
    assert {draw_thinking_budget(LengthControlSettings(thinking_budget_tokens=(7, 7)), str(i)) for i in range(50)} == {
        7
    }


def test_length_control_is_off_by_default_and_checks_its_settings() -> None:
    off = LengthControlSettings()
    assert not off.enabled and off.interruption_phrase == SCALERL_PHRASE
    with pytest.raises(ValueError, match="length control is off"):
        draw_thinking_budget(off, "t")
    for bad, match in [
        ({"thinking_budget_tokens": (8, 5)}, r"1 <= low <= high, got \[8, 5\]"),
        ({"thinking_budget_tokens": (0, 5)}, r"1 <= low <= high, got \[0, 5\]"),
        ({"thinking_budget_tokens": (4, 5), "interruption_phrase": " "}, "interruption_phrase must not be empty"),
        ({"think_end": ""}, "think_end must not be empty"),
        ({"answer_budget_tokens": 0}, "answer_budget_tokens"),
    ]:
        with pytest.raises(ValidationError, match=match):
            LengthControlSettings.model_validate(bad)


def _sample(n: int, spans: list[tuple[int, int, int]], finish: str, text: str, stop: str | None = None) -> Sample:
    return Sample(
        token_ids=list(range(10, 10 + n)),
        logprobs=[-0.5 - i for i in range(n)],
        version_spans=spans,
        finish_reason=finish,
        text=text,
        stop_reason=stop,
    )


def test_what_follows_a_first_part() -> None:
    # Reached its budget (5 tokens) still thinking: the phrase, then the answer budget (6).
    still = _sample(5, [(0, 0, 5)], "length", "hmm hmm")
    assert continuation(still, ON, PHRASE_IDS, max_tokens=100) == Continuation(PHRASE_IDS, 6)
    # ... unless the task's max_tokens leaves less: 5 + 3 phrase tokens + 4 = 12.
    assert continuation(still, ON, PHRASE_IDS, max_tokens=12) == Continuation(PHRASE_IDS, 4)
    # No room after the phrase: stays as it is (truncated, not interrupted).
    assert continuation(still, ON, PHRASE_IDS, max_tokens=8) is None
    # Closed its thinking within the budget: no phrase, the answer budget.
    closed = _sample(4, [(0, 0, 4)], "stop", "so </think>", stop="</think>")
    assert continuation(closed, ON, PHRASE_IDS, max_tokens=100) == Continuation([], 6)
    # Ended by itself (end of sequence), thinking or not: done.
    assert continuation(_sample(3, [(0, 0, 3)], "stop", "hmm"), ON, PHRASE_IDS, 100) is None


def test_splice_masks_the_phrase_and_moves_the_second_spans() -> None:
    first = _sample(3, [(2, 0, 3)], "length", "abc")
    # The continuation was sampled by version 2, then 3 after a swap mid-request.
    second = _sample(4, [(2, 0, 1), (3, 1, 4)], "stop", " 42")
    out = splice(first, PHRASE_IDS, " TIME UP", second)
    assert out.token_ids == [10, 11, 12, 90, 91, 92, 10, 11, 12, 13]
    assert out.logprobs == [-0.5, -1.5, -2.5, 0.0, 0.0, 0.0, -0.5, -1.5, -2.5, -3.5]
    assert out.loss_mask == [1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    assert out.version_spans == [(2, 0, 3), (2, 6, 7), (3, 7, 10)]
    assert out.text == "abc TIME UP 42"
    assert (out.finish_reason, out.interrupted, out.truncated) == ("stop", True, False)
    # Thinking closed by itself: nothing injected, every token in the loss, spans contiguous.
    plain = splice(first, [], "", second)
    assert (plain.loss_mask, plain.interrupted) == ([], False)
    assert plain.version_spans == [(2, 0, 3), (2, 3, 4), (3, 4, 7)]


def _group(c: rollout_pb2.Completion) -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(
        group_id="g",
        task=rollout_pb2.GenerationTask(task_id="g", sampling=rollout_pb2.SamplingParams(temperature=1.0)),
        prompt_token_ids=[1, 2],
        completions=[c],
    )


def test_the_learner_mask_excludes_exactly_the_injected_tokens() -> None:
    from services.learner.trainer import collate

    first = _sample(3, [(2, 0, 3)], "length", "abc")
    second = _sample(2, [(4, 0, 2)], "length", "de")
    g = _group(completion(splice(first, PHRASE_IDS, "!", second), reward=1.0))
    validate_group(g)  # the spans leave only the phrase uncovered
    assert (g.completions[0].interrupted, g.completions[0].truncated) == (True, True)
    inputs = collate([g], pad_id=0)
    assert inputs.loss_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 1, 1]
    assert inputs.token_versions[0].tolist() == [2, 2, 2, 0, 0, 0, 4, 4]
    assert inputs.logp_gen[0].tolist() == [-0.5, -1.5, -2.5, 0.0, 0.0, 0.0, -0.5, -1.5]


def test_spans_may_skip_only_tokens_out_of_the_loss() -> None:
    def with_spans(spans: list[tuple[int, int, int]], mask: list[int]) -> rollout_pb2.RolloutGroup:
        s = Sample(list(range(10, 16)), [-1.0] * 6, spans, "stop", "x", loss_mask=mask)
        return _group(completion(s, reward=0.0))

    validate_group(with_spans([(0, 0, 2), (1, 4, 6)], [1, 1, 0, 0, 1, 1]))
    validate_group(with_spans([(0, 0, 4)], [1, 1, 1, 1, 0, 0]))  # masked tail
    with pytest.raises(PayloadError, match=r"must tile the tokens in the loss: \[2, 4\) is uncovered"):
        validate_group(with_spans([(0, 0, 2), (1, 4, 6)], [1, 1, 0, 1, 1, 1]))
    with pytest.raises(PayloadError, match="version spans cover 4 of 6 tokens"):
        validate_group(with_spans([(0, 0, 4)], [1, 1, 1, 1, 1, 0]))
