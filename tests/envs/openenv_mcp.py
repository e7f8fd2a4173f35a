"""An OpenEnv MCP environment written against OpenEnv's public API, for the adapter's tests.

``Arithmetic`` is an ``MCPEnvironment`` whose tools live on a FastMCP
server in the same process: ``add`` and ``divide``, and ``submit``, which
ends the episode with reward 1 when the answer is the task's reference.
Runs on the environments' interpreter (``.venv-envs``), which has openenv
and fastmcp.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State


class Arithmetic(MCPEnvironment):
    def __init__(self) -> None:
        mcp = FastMCP("arithmetic")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool
        def divide(a: float, b: float) -> float:
            """Divide a by b."""
            return a / b

        @mcp.tool
        def submit(answer: str) -> str:
            """Submit the final answer."""
            return answer

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self.reference = ""

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, reference: str = "", **kwargs: Any
    ) -> Observation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        self.reference = reference
        return Observation()

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            right = str(action.arguments.get("answer", "")).strip() == self.reference
            return CallToolObservation(tool_name="submit", result=None, done=True, reward=1.0 if right else 0.0)
        return await super().step_async(action, timeout_s=timeout_s, **kwargs)

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=True, reward=0.0)

    @property
    def state(self) -> State:
        return self._state
