"""The chat template's difference, tokenised alone, on the test tokenizers with Qwen3's and Llama 3's formats.

Each expected text is written out by hand from the format; the ids must be
what tokenising that text alone gives, and, for a turn the model wrote as
the template writes it, prompt + turn + environment tokens must be exactly
what tokenising the whole new rendering gives (no boundary effect).
"""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from asymptote.envs.base import Message
from asymptote.envs.transcript import Transcript
from tests.envs.chat_models import Flavour, chat_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
QUESTION: list[Message] = [{"role": "user", "content": "What is 2 + 3?"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
RESULT: list[Message] = [{"role": "tool", "name": "add", "content": "5"}]

AFTER_RESULT = {
    "qwen3": "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "llama": "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
}
"""What follows a turn's end token when the tool's result comes back, in each format."""


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tok(request: pytest.FixtureRequest) -> Any:
    tokenizer = chat_tokenizer(request.param)
    tokenizer.flavour = request.param
    return tokenizer


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def test_a_tool_result_after_an_ended_turn_is_the_formats_text(tok: Any) -> None:
    transcript = Transcript(tok, QUESTION, TOOLS)
    prompt = transcript.prompt_ids()
    turn = f"Let me add.\n{CALL}" if tok.flavour == "qwen3" else "Let me add."
    turn_ids = [*encode(tok, turn), tok.eos_token_id]
    ext = transcript.extend(turn_ids, RESULT)
    assert ext is not None
    assert ext.text == AFTER_RESULT[tok.flavour]
    assert ext.ids == encode(tok, ext.text)
    # The turn is written as the template writes it: the whole rendering tokenises to the same ids.
    assert prompt + turn_ids + ext.ids == encode(tok, transcript.rendered)


def test_a_turn_cut_at_its_limit_is_closed_with_the_end_token(tok: Any) -> None:
    transcript = Transcript(tok, QUESTION, TOOLS)
    ext = transcript.extend(encode(tok, "Let me"), RESULT)
    assert ext is not None
    assert ext.text == tok.eos_token + AFTER_RESULT[tok.flavour]
    assert ext.ids[0] == tok.eos_token_id
    assert ext.ids == encode(tok, ext.text)


def test_many_turns_grow_the_stream_exactly_as_the_rendering(tok: Any) -> None:
    transcript = Transcript(tok, [{"role": "system", "content": "Be brief."}, *QUESTION], TOOLS)
    stream = transcript.prompt_ids()
    num_env_tokens = 0
    for k in range(6):
        turn = f"Step {k}: thinking about {k * 7}."
        turn_ids = [*encode(tok, turn), tok.eos_token_id]
        reply: list[Message] = (
            [{"role": "tool", "name": "add", "content": str(k)}]
            if k % 2
            else [{"role": "user", "content": f"Go on ({k})."}]
        )
        ext = transcript.extend(turn_ids, reply)
        assert ext is not None
        stream += turn_ids + ext.ids
        num_env_tokens += len(ext.ids)
        assert stream == encode(tok, transcript.rendered)
    assert num_env_tokens > 6 * 5


def test_qwen3_keeps_extending_while_the_model_thinks_between_tool_calls() -> None:
    tok = chat_tokenizer("qwen3")
    transcript = Transcript(tok, QUESTION, TOOLS)
    turn = f"<think>\nI should add.\n</think>\n\n{CALL}"
    ext = transcript.extend([*encode(tok, turn), tok.eos_token_id], RESULT)
    # Tool results are not user queries: the think block stays in every later rendering.
    assert ext is not None and ext.text == AFTER_RESULT["qwen3"]
    assert "I should add." in transcript.rendered


def test_qwen3_dropping_past_think_blocks_starts_a_new_sample() -> None:
    tok = chat_tokenizer("qwen3")
    transcript = Transcript(tok, QUESTION, TOOLS)
    turn = "<think>\nI should add.\n</think>\n\nIt is 5."
    question: list[Message] = [{"role": "user", "content": "And 5 + 5?"}]
    ext = transcript.extend([*encode(tok, turn), tok.eos_token_id], question)
    assert ext is None
    # The new sample's prompt is the whole new rendering, in which the earlier turn lost its thinking.
    assert "I should add." not in transcript.rendered
    assert transcript.rendered.endswith(
        "<|im_start|>assistant\nIt is 5.<|im_end|>\n<|im_start|>user\nAnd 5 + 5?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert transcript.prompt_ids() == encode(tok, transcript.rendered)


def test_qwen3_with_thinking_off_re_renders_every_turn() -> None:
    tok = chat_tokenizer("qwen3")
    transcript = Transcript(tok, QUESTION, TOOLS, {"enable_thinking": False})
    assert transcript.rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ext = transcript.extend([*encode(tok, CALL), tok.eos_token_id], RESULT)
    # The empty think block the prompt ended with is not in the turn's rendering once results follow it.
    assert ext is None


def test_a_tokenizer_without_a_template_is_refused() -> None:
    tok = chat_tokenizer("qwen3")
    tok.chat_template = None
    with pytest.raises(ValueError, match="need a tokenizer with a chat_template"):
        Transcript(tok, QUESTION)


def test_a_call_written_otherwise_than_the_template_writes_it_starts_a_new_sample() -> None:
    tok = chat_tokenizer("qwen3")
    transcript = Transcript(tok, QUESTION, TOOLS)
    turn = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'
    assert transcript.extend([*encode(tok, turn), tok.eos_token_id], RESULT) is None
    # The call itself was understood: the new rendering holds it in the template's own form.
    assert CALL in transcript.rendered


@pytest.mark.parametrize("flavour", ["qwen3", "llama"])
def test_special_tokens_the_model_sampled_stay_in_its_turn(flavour: Flavour) -> None:
    """A turn holding a special token mid-text renders it as the same token: the stream still extends."""
    tok = chat_tokenizer(flavour)
    transcript = Transcript(tok, QUESTION)
    prompt = transcript.prompt_ids()
    turn_ids = [*encode(tok, "Odd"), tok.pad_token_id, *encode(tok, " turn"), tok.eos_token_id]
    ext = transcript.extend(turn_ids, RESULT)
    assert ext is not None and ext.text == AFTER_RESULT[flavour]
    assert prompt + turn_ids + ext.ids == encode(tok, transcript.rendered)


@pytest.mark.parametrize("turn", [" It is 5.", "It is 5.\n\n", "\n"])
def test_a_turn_without_calls_extends_with_its_white_space_as_sampled(tok: Any, turn: str) -> None:
    transcript = Transcript(tok, QUESTION)
    prompt = transcript.prompt_ids()
    turn_ids = [*encode(tok, turn), tok.eos_token_id]
    ext = transcript.extend(turn_ids, RESULT)
    assert ext is not None and ext.text == AFTER_RESULT[tok.flavour]
    assert prompt + turn_ids + ext.ids == encode(tok, transcript.rendered)
