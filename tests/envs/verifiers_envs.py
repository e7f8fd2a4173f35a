"""verifiers environments written against verifiers' public API, as its users write them (imported in workers
on the environments' own interpreter, .venv-envs, which has verifiers).

``load_tool_env``: a ``ToolEnv`` with one tool, ``add``, a system prompt,
and a rubric that pays 1 when the final answer contains the task's answer.
``Countdown``: a ``MultiTurnEnv`` that answers each turn with the turns
left and stops after ``rounds`` turns; its rubric pays the share of the
model's turns that repeated the last number it was told.
"""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset

ANSWER_SHOWN = "The answer is"

_DATASET = Dataset.from_list([{"question": "unused: the tasks come from the run", "answer": "0"}])


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def _text(message: Any) -> str:
    content = message.content if hasattr(message, "content") else message.get("content")
    return content if isinstance(content, str) else ""


def contains_answer(completion: list[Any], answer: str, **kwargs: Any) -> float:
    return float(answer in _text(completion[-1]))


def load_tool_env(max_turns: int = 4, **kwargs: Any) -> vf.Environment:
    return vf.ToolEnv(
        dataset=_DATASET,
        tools=[add],
        max_turns=max_turns,
        system_prompt="Use the add tool, then say the answer.",
        rubric=vf.Rubric(funcs=[contains_answer]),
    )


def repeated_share(completion: list[Any], state: Any, **kwargs: Any) -> float:
    told = state.get("told", [])
    said = [_text(m).strip() for m in completion if getattr(m, "role", None) == "assistant"]
    return sum(s == t for s, t in zip(said, told, strict=False)) / max(1, len(said))


class Countdown(vf.MultiTurnEnv):
    def __init__(self, rounds: int = 3, **kwargs: Any) -> None:
        super().__init__(dataset=_DATASET, max_turns=rounds, rubric=vf.Rubric(funcs=[repeated_share]), **kwargs)
        self.rounds = rounds

    async def setup_state(self, state: vf.State) -> None:
        state["told"] = [str(self.rounds)]

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        left = self.rounds - len(state["trajectory"])
        state["told"].append(str(left))
        return [{"role": "user", "content": str(left)}]


class NotAnEnvironment:
    """Makes something that is not a verifiers environment."""
