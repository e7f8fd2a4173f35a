"""Turning a dataset prompt into the text a model continues.

Owns the chat and plain templates. Runs where the tokenizer is (the
generator); the broker passes the file's prompt text unchanged.
"""

from __future__ import annotations

from typing import Any, Protocol

from asymptote.tasks.dataset import DatasetSettings


class ChatTokenizer(Protocol):
    chat_template: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def render_prompt(prompt: str, settings: DatasetSettings, tokenizer: ChatTokenizer | None) -> str:
    """The model's input for ``prompt``: the chat template (a system message first when one is set) or,
    for base models, the plain text with the system prompt as a leading paragraph.

    ValueError when the chat template is asked for and the tokenizer has none.
    """
    user = settings.prompt_format.format(prompt=prompt)
    if settings.template == "plain":
        return f"{settings.system_prompt}\n\n{user}" if settings.system_prompt else user
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("template 'chat' needs a tokenizer with a chat_template; use template 'plain' for base models")
    messages = [{"role": "user", "content": user}]
    if settings.system_prompt:
        messages.insert(0, {"role": "system", "content": settings.system_prompt})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected text")
    return text
