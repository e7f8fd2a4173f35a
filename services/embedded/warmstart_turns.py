"""Warm start on a multi-turn task: demonstrated episodes, and the sampled pass rate of whole episodes.

Owns what the tiny model is taught on a ``multiturn`` task and how it is
judged. The demonstration is the calculator's episode (the ``words-tools``
workload, asymptote/envs/calculator.py): in its first turn the model calls
the environment's ``calculate`` tool with one expression for the row's
worked steps (asymptote/tasks/words.py, ``solution_expression``); in its
second, after the tool's answer, it writes that answer in ``\\boxed{}``.
Both turns are played against the task's own environment, run in this
process, and rendered by the model's chat template through
``asymptote.envs.transcript``: a demonstration the template cannot extend
token for token is refused, so what is taught is what a generator's
episode stores. Each turn is one supervised sample, its prompt the
episode's tokens so far (the environment's included).

The stop rule samples whole episodes as a generator plays them (the
model's turns sampled, the environment's answers appended through the
template's difference) and scores each as the task does: the
environment's reward, else the dataset's verifier on the final turn.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asymptote.envs.base import Environment, EnvTask, check_reset, check_step
from asymptote.envs.pool import load_factory
from asymptote.envs.transcript import Transcript
from asymptote.tasks import MultiTurnTask, Problem
from asymptote.tasks.multiturn import episode_prompt
from asymptote.tasks.readers import DatasetError
from asymptote.tasks.words import solution_expression
from services.learner.model import Samples, sample

MULTITURN_FORMAT_VERSION = 1
"""Bump when a multi-turn task's demonstrations change, so cached models are rebuilt."""
CALCULATOR_TOOL = "calculate"
"""The tool a demonstration's first turn calls, with the worked steps' expression as ``expression``."""


@dataclass(frozen=True)
class Demonstration:
    """One problem's demonstrated episode: each model turn's prompt ids (all tokens before it) and its ids."""

    prompts: list[list[int]]
    turns: list[list[int]]
    """Each turn's tokens, ending with the end-of-turn token."""
    text: str
    """The whole episode as the chat template renders it (what a tokenizer is trained on)."""


def _env_task(task: MultiTurnTask, problem: Problem) -> EnvTask:
    return EnvTask(
        task_id=problem.prompt_id, prompt=episode_prompt(task.settings, problem.prompt), reference=problem.reference
    )


def demonstrate(
    task: MultiTurnTask,
    tokenizer: PreTrainedTokenizerBase,
    problem: Problem,
    solution: str,
    env: Environment,
    loop: asyncio.AbstractEventLoop,
) -> Demonstration:
    """``problem``'s demonstrated episode against ``env`` (a new episode of the task's environment).

    DatasetError when the environment has no calculator, answers otherwise
    than the row's answer, or the template cannot extend the episode token
    for token.
    """
    messages, tools = check_reset(loop.run_until_complete(env.reset(_env_task(task, problem))))
    if not any(t.get("function", {}).get("name") == CALCULATOR_TOOL for t in tools):
        raise DatasetError(
            f"the tiny model's warm start on a multi-turn task demonstrates the {CALCULATOR_TOOL!r} tool "
            f"(asymptote.envs.calculator:Calculator); environment {task.settings.environment.entry!r} has none: "
            "give model_dir to train a model of your own"
        )
    transcript = Transcript(tokenizer, messages, tools, task.settings.chat_template_kwargs)
    call = {"name": CALCULATOR_TOOL, "arguments": {"expression": solution_expression(solution)}}
    first = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    prompt = transcript.prompt_ids()
    first_ids = [*transcript.encode(first), transcript.end_id]
    result = check_step(loop.run_until_complete(env.step(first)))
    answers = [m["content"] for m in result.observation if m["role"] == "tool"]
    if result.done or answers != [problem.reference]:
        raise DatasetError(
            f"problem {problem.prompt_id}: the calculator answered {answers} for {call['arguments']}, "
            f"not the row's answer {problem.reference!r}"
        )
    extension = transcript.extend(first_ids, result.observation)
    if extension is None:
        raise DatasetError(f"problem {problem.prompt_id}: the chat template re-renders the demonstrated tool call")
    second = f"\\boxed{{{answers[0]}}}"
    second_prompt = prompt + first_ids + extension.ids
    text = transcript.rendered + second + transcript.end_text
    return Demonstration(
        prompts=[prompt, second_prompt], turns=[first_ids, [*transcript.encode(second), transcript.end_id]], text=text
    )


def demonstrations(
    task: MultiTurnTask, tokenizer: PreTrainedTokenizerBase, problems: Sequence[Problem], solutions: dict[str, str]
) -> list[Demonstration]:
    """Every problem's demonstrated episode (``solutions``: each row's worked steps by problem id)."""
    factory = load_factory(task.settings.environment)
    loop = asyncio.new_event_loop()
    try:
        return [demonstrate(task, tokenizer, p, solutions[p.prompt_id], factory(), loop) for p in problems]
    finally:
        loop.close()


@dataclass
class _Episode:
    problem: Problem
    env: Environment
    transcript: Transcript
    ids: list[int]
    used: int = 0
    """Tokens after the first prompt (the model's and the environment's), as ``max_episode_tokens`` counts."""
    final_turn: str = ""
    reward: float | None = None
    done: bool = False


Sampler = Callable[[list[list[int]], int], Samples]
"""One turn of every episode in flight: (their token ids so far, max new tokens) -> the turns sampled."""


@dataclass(frozen=True)
class EpisodeRates:
    pass_rate: float
    """Mean reward over all episodes."""
    num_prompts: int
    num_samples: int
    truncation_rate: float
    """Fraction of model turns cut at ``max_turn_tokens``."""
    mean_turns: float


@torch.no_grad()
def episode_pass_rate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: MultiTurnTask,
    problems: Sequence[Problem],
    num_samples_per_prompt: int,
    temperature: float = 1.0,
    seed: int = 0,
    sampler: Sampler | None = None,
) -> EpisodeRates:
    """Mean reward of ``num_samples_per_prompt`` episodes of every problem, played under the task's limits
    (turns, tokens per turn and per episode, what a cut turn does) against its environment in this process, the model's turns
    sampled in one batch per turn (by ``sampler`` when given, instead of the model)."""
    limits = task.settings.environment
    factory = load_factory(limits)
    loop = asyncio.new_event_loop()
    gen = torch.Generator().manual_seed(seed)

    def from_model(prompts: list[list[int]], max_new_tokens: int) -> Samples:
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        return sample(model, prompts, max_new_tokens, eos, pad, temperature=temperature, generator=gen)

    sampler = sampler or from_model
    was_training = model.training
    model.eval()
    episodes: list[_Episode] = []
    try:
        for problem in problems:
            for _ in range(num_samples_per_prompt):
                env = factory()
                messages, tools = check_reset(loop.run_until_complete(env.reset(_env_task(task, problem))))
                transcript = Transcript(tokenizer, messages, tools, task.settings.chat_template_kwargs)
                episodes.append(_Episode(problem, env, transcript, transcript.prompt_ids()))
        num_turns = truncated = 0
        for turn in range(limits.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            room = min(limits.max_episode_tokens - e.used for e in active)
            out = sampler([e.ids for e in active], max(1, min(limits.max_turn_tokens, room)))
            for e, ids, cut in zip(active, out.completions, out.truncated):
                num_turns += 1
                truncated += cut
                e.final_turn = str(tokenizer.decode(ids, skip_special_tokens=True))
                if cut and limits.cut_turn == "end":
                    e.done = True
                    continue
                result = check_step(loop.run_until_complete(e.env.step(e.final_turn)))
                if result.done or turn == limits.max_turns - 1:
                    e.done, e.reward = True, result.reward
                    continue
                extension = e.transcript.extend(ids, result.observation)
                if extension is None:  # re-rendered: the next turn is sampled after the whole rendering
                    e.ids = e.transcript.prompt_ids()
                    e.used += len(ids)
                else:
                    e.ids = e.ids + ids + extension.ids
                    e.used += len(ids) + len(extension.ids)
                e.done = e.used >= limits.max_episode_tokens
    finally:
        loop.close()
        model.train(was_training)
    total = sum(e.reward if e.reward is not None else task.score(e.final_turn, e.problem.reference) for e in episodes)
    return EpisodeRates(
        pass_rate=total / len(episodes),
        num_prompts=len(problems),
        num_samples=len(episodes),
        truncation_rate=truncated / max(1, num_turns),
        mean_turns=num_turns / len(episodes),
    )
