"""Environment classes the tests import by entry (``tests.envs.tool_classes:Name``) in environment workers.

Each well-behaved one is deterministic; each misbehaving one fails in one
way the pool must contain.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from asymptote.envs.base import EnvTask, Message

ENVS_PYTHON = Path(__file__).resolve().parents[2] / ".venv-envs" / "bin" / "python"
"""The environments' own interpreter (scripts/setup.sh installs it): openenv and verifiers, no torch."""


class Calculator:
    """Arithmetic tools; the episode's answer is right when it contains the task's reference."""

    def __init__(self, task: EnvTask) -> None:
        self.task = task
        self.num_calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first addend.
            b: The second addend.
        """
        self.num_calls += 1
        return a + b

    def divide(self, a: float, b: float) -> float:
        """Divide one number by another.

        Args:
            a: The dividend.
            b: The divisor.
        """
        self.num_calls += 1
        return a / b

    def reward(self, answer: str) -> float:
        return 1.0 if self.task.reference in answer else 0.0


class Counter:
    """A deterministic conversation: answers each turn by its length, alternately as a tool result and as
    the user; done after ``int(task.reference)`` turns with the number of turns as reward."""

    def __init__(self) -> None:
        self.turns = 0
        self.done_after = 0

    async def reset(self, task: EnvTask) -> tuple[list[Message], list[dict[str, Any]]]:
        self.done_after = int(task.reference)
        tool = {
            "type": "function",
            "function": {
                "name": "count",
                "description": "Count the characters of a turn.",
                "parameters": {"type": "object", "properties": {}},
            },
        }
        return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": task.prompt}], [tool]

    async def step(self, assistant_turn: str) -> tuple[list[Message], float | None, bool]:
        self.turns += 1
        if self.turns >= self.done_after:
            return [], float(self.turns), True
        if self.turns % 2:
            return [{"role": "tool", "name": "count", "content": f"{len(assistant_turn)} characters"}], None, False
        return [{"role": "user", "content": f"Turn {self.turns} done. Go on."}], None, False


GATE_ENV = "ASY_TEST_ENV_GATE"
"""The gate file of Misbehaves' "gate" mode (environment workers inherit the test's environment)."""


class Misbehaves(Counter):
    """Fails its first step (or its reset) in the way the task's reference names; "well" behaves as Counter
    for two turns. Modes: raise, hang, garbage, role, oversize, crash, reset-hang, reset-raise, well; and
    gate, whose first step appends the task's id to ``$GATE.arrived`` and waits until the file named by
    GATE_ENV exists (a tool call that takes as long as the test wants), then behaves as "well"."""

    mode = "well"
    task_id = ""

    async def reset(self, task: EnvTask) -> tuple[list[Message], list[dict[str, Any]]]:
        self.mode, self.task_id = task.reference, task.task_id
        if self.mode == "reset-hang":
            threading.Event().wait()
        if self.mode == "reset-raise":
            raise RuntimeError("the environment could not start")
        return await super().reset(task.model_copy(update={"reference": "2"}))

    async def step(self, assistant_turn: str) -> Any:
        if self.mode == "raise":
            raise RuntimeError("the environment's own bug")
        if self.mode == "hang":
            threading.Event().wait()  # blocks its worker for good, as a stuck C call or a deadlock would
        if self.mode == "garbage":
            return [{"role": "tool", "content": 42}], "high", "yes"
        if self.mode == "role":
            return [{"role": "narrator", "content": "Meanwhile..."}], None, False
        if self.mode == "oversize":
            return [{"role": "tool", "name": "count", "content": "x" * 2**20}], None, False  # a megabyte
        if self.mode == "crash":
            os._exit(3)
        if self.mode == "gate":
            gate = Path(os.environ[GATE_ENV])
            with open(f"{gate}.arrived", "a") as arrived:
                arrived.write(f"{self.task_id}\n")
            while not gate.exists():
                time.sleep(0.05)  # pacing: polls of the gate the test opens (the tool's timeout bounds it)
            self.mode = "well"
        return await super().step(assistant_turn)


class NoDocstring:
    def add(self, a: int, b: int) -> int:
        return a + b


class WhereAmI:
    """Says which interpreter hosts it: its first message names ``sys.prefix`` and whether torch and
    openenv import there (an environment's own virtual environment has openenv and no torch)."""

    async def reset(self, task: EnvTask) -> tuple[list[Message], list[dict[str, Any]]]:
        import importlib.util
        import sys

        found = {name: importlib.util.find_spec(name) is not None for name in ("torch", "openenv")}
        return [{"role": "user", "content": json.dumps({"prefix": sys.prefix, **found})}], []

    async def step(self, assistant_turn: str) -> tuple[list[Message], float | None, bool]:
        return [], 1.0, True
