"""An OpenEnv environment written against OpenEnv's public API, as its users write them (imported in workers
on the environments' own interpreter, .venv-envs, which has openenv).

A guessing game: the environment knows the task's reference (a number),
each action is a guess, each observation says higher, lower or correct;
the episode ends when the guess is right (reward 1) or after MAX_GUESSES
(reward 0). Served by ``python -m tests.envs.openenv_guess PORT`` (OpenEnv's
FastAPI app under uvicorn), reached by ``GuessClient``; or run in the
worker as ``GuessEnvironment``.
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Environment, create_fastapi_app
from openenv.core.env_server.types import Action, Observation, State

MAX_GUESSES = 3


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str = ""


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self.secret = 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, reference: str = "0", **kwargs: Any
    ) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        self.secret = int(reference)
        return GuessObservation(feedback=f"Guess the number. You have {MAX_GUESSES} guesses.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        try:
            guess = int(action.guess.strip())
        except ValueError:
            feedback = f"{action.guess.strip()!r} is not a number."
        else:
            if guess == self.secret:
                return GuessObservation(feedback="correct", done=True, reward=1.0)
            feedback = "higher" if guess < self.secret else "lower"
        if self._state.step_count >= MAX_GUESSES:
            return GuessObservation(feedback=feedback, done=True, reward=0.0)
        return GuessObservation(feedback=feedback)

    @property
    def state(self) -> State:
        return self._state


class AsyncGuessEnvironment(GuessEnvironment):
    """The game with a reset of its own that is async and takes the reference; its sync ``reset`` does not."""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        raise AssertionError("the async reset is the one to call")

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, reference: str = "0"
    ) -> GuessObservation:
        return super().reset(seed, episode_id, reference)


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    def _step_payload(self, action: GuessAction) -> dict[str, Any]:
        return {"guess": action.guess}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[GuessObservation]:
        observation = GuessObservation(
            **payload.get("observation", {}), done=payload.get("done", False), reward=payload.get("reward")
        )
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=8)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
