"""A conversation's tokens grown turn by turn through the chat template's difference (torch-free).

Owns token-in, token-out for the environment's side of an episode. The
model's tokens are never re-tokenised: the caller keeps them as sampled.
Only the text the chat template adds for the environment's new messages is
tokenised. After a model turn and the environment's answer, the whole
conversation (the turn as an assistant message, its ``<tool_call>`` calls
parsed) is rendered again with ``apply_chat_template`` and compared with
the text the stream so far stands for:

- when the new rendering starts with the old one followed by the model's
  turn exactly as sampled and the end-of-turn token, the template extends
  the history: the environment's text is the rest (the template's turn
  separator, the new messages, the next generation prompt), tokenised
  alone. A turn the model did not end (cut at its token limit) gets the
  end token in front of it.
- otherwise the template re-renders earlier text: Qwen3 drops the
  ``<think>`` blocks of turns before a new user message and the empty think
  block of a prompt with thinking off; a template may write a tool call
  otherwise than the model did. The stream cannot then be extended token
  for token, and the caller starts a new training sample from the full
  rendering's tokens.

So every stream decodes to the template's own rendering of its
conversation. Knows nothing about engines, log-probs or environments' processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from asymptote.envs.base import Message
from asymptote.envs.tools import parse_turn


class ChatTokenizer(Protocol):
    """What a Hugging Face tokenizer offers here (typed loosely: transformers' own signatures are wide)."""

    eos_token: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: Any, **kwargs: Any) -> Any: ...

    def decode(self, token_ids: Any, **kwargs: Any) -> Any: ...

    def convert_tokens_to_ids(self, tokens: Any) -> Any: ...


@dataclass(frozen=True)
class Extension:
    """The environment's tokens after a model turn: ``text`` tokenised alone as ``ids``."""

    text: str
    ids: list[int]


def check_chat_tokenizer(tokenizer: ChatTokenizer) -> None:
    """ValueError when ``tokenizer`` cannot render episodes: no chat template, or no end-of-sequence token."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("multi-turn episodes need a tokenizer with a chat_template")
    if not isinstance(tokenizer.eos_token, str) or not tokenizer.eos_token:
        raise ValueError("multi-turn episodes need a tokenizer with an eos_token (the end of a turn)")


class Transcript:
    """The messages of one conversation and the rendering its token stream stands for.

    ``tools`` and ``template_kwargs`` (such as ``enable_thinking``) go to
    every rendering. ValueError when the tokenizer has no chat template or
    no end-of-sequence token (the end of an assistant turn).
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        messages: list[Message],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        check_chat_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.end_text: str = tokenizer.eos_token
        self.end_id = int(tokenizer.convert_tokens_to_ids(self.end_text))
        self.tools = tools or None
        self.template_kwargs = template_kwargs or {}
        self.messages = list(messages)
        self.rendered = self.render(self.messages)
        """The rendering (through the last generation prompt) that the stream so far stands for."""

    def render(self, messages: list[Message]) -> str:
        """``messages`` through the chat template, ending with the generation prompt."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected text")
        return text

    def encode(self, text: str) -> list[int]:
        # Special tokens are in the rendered text already: a BOS added here would be a second one.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self) -> list[int]:
        """The whole rendering's tokens: the prompt of a (new) training sample."""
        return self.encode(self.rendered)

    def extend(self, turn_ids: list[int], observation: list[Message]) -> Extension | None:
        """Append the model's turn (its tokens as sampled) and ``observation``; the tokens that follow
        ``turn_ids`` in the stream, or None when the template re-renders earlier text (see the module
        docstring; the transcript then stands for the new rendering, whose tokens ``prompt_ids`` gives).

        ValueError, TypeError or jinja2's TemplateError (raised by the template) for messages it refuses.
        """
        ended = bool(turn_ids) and turn_ids[-1] == self.end_id
        text = str(self.tokenizer.decode(turn_ids[:-1] if ended else turn_ids, skip_special_tokens=False))
        old = self.rendered
        self.messages += [parse_turn(text).message(), *observation]
        self.rendered = new = self.render(self.messages)
        sampled = old + text + self.end_text
        if not new.startswith(sampled):
            return None
        added = new[len(sampled) :] if ended else new[len(old) + len(text) :]
        return Extension(added, self.encode(added))
