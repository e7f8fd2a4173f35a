"""The warm start on a multi-turn task: demonstrated calculator episodes, and whole episodes as its probe.

The demonstrations are played against the real calculator environment and
rendered by the project's chat template (Qwen3's); the probe's episode loop
is driven by a scripted policy standing in for the model's sampling, so
that its pass rate, turn counts and truncation rate have exact expected
values.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from asymptote.envs.calculator import evaluate, shown
from asymptote.envs.pool import load_factory
from asymptote.tasks import DatasetSettings, MultiTurnSettings, MultiTurnTask, Problem, words
from asymptote.tasks.readers import DatasetError
from services.embedded.build import ModelSpec, build_model, train_bpe_tokenizer, word_problem_corpus
from services.embedded.warmstart import (
    MULTITURN_BPE_VOCAB_SIZE,
    cache_key,
    tiny_model_settings,
    tokenizer_for,
    tokenizer_texts,
    training_pairs,
)
from services.embedded.warmstart_turns import Sampler, demonstrate, episode_pass_rate
from services.learner.model import Samples
from services.local.workloads import workload_task

PREFIX = "Solve: "


def words_tools(tmp_path: Path, num_train: int = 24, num_heldout: int = 6, **environment: object) -> MultiTurnTask:
    rows = words.generate(num_train, num_heldout, seed=11)
    for split, split_rows in rows.items():
        (tmp_path / f"{split}.jsonl").write_text(words.render(split_rows))
    shipped = workload_task("words-tools")
    settings = shipped.model_copy(
        update={
            "dataset": DatasetSettings(
                path=tmp_path / "train.jsonl",
                eval_path=tmp_path / "heldout.jsonl",
                template="chat",
                prompt_format=PREFIX + "{prompt}",
            ),
            "environment": shipped.environment.model_copy(update=environment),
        }
    )
    return MultiTurnTask(settings)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_bpe_tokenizer(word_problem_corpus(), 512)


def solutions(tmp_path: Path) -> dict[str, str]:
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    return {r["id"]: r["solution"] for r in rows}


def test_a_demonstration_calls_the_calculator_then_boxes_its_answer_token_for_token(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    task = words_tools(tmp_path)
    worked = solutions(tmp_path)
    factory = load_factory(task.settings.environment)
    loop = asyncio.new_event_loop()
    try:
        for problem in task.problems("train")[:8]:
            demo = demonstrate(task, tokenizer, problem, worked[problem.prompt_id], factory(), loop)
            expression = words.solution_expression(worked[problem.prompt_id])
            call = {"name": "calculate", "arguments": {"expression": expression}}
            first = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
            messages = [{"role": "user", "content": PREFIX + problem.prompt}]
            tools = factory().schemas  # type: ignore[attr-defined]
            rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert tokenizer.decode(demo.prompts[0]) == rendered
            assert demo.turns[0] == [*tokenizer.encode(first, add_special_tokens=False), tokenizer.eos_token_id]
            # The second turn's prompt is the first one's, the model's turn and the environment's tokens after it,
            # which decode to the template's rendering of the whole conversation.
            assert demo.prompts[1][: len(demo.prompts[0]) + len(demo.turns[0])] == demo.prompts[0] + demo.turns[0]
            answer = shown(evaluate(expression))
            assert answer == problem.reference
            history = [
                *messages,
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                {"role": "tool", "name": "calculate", "content": answer},
            ]
            again = tokenizer.apply_chat_template(history, tools=tools, tokenize=False, add_generation_prompt=True)
            assert tokenizer.decode(demo.prompts[1]) == again
            assert tokenizer.decode(demo.turns[1]) == f"\\boxed{{{answer}}}<|im_end|>"
            assert task.score(tokenizer.decode(demo.turns[1], skip_special_tokens=True), problem.reference) == 1.0
            assert demo.text == again + f"\\boxed{{{answer}}}<|im_end|>"
    finally:
        loop.close()


def test_the_supervised_pass_takes_each_turn_as_a_sample(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    task = words_tools(tmp_path)
    problems = task.problems("train")[:5]
    prompts, targets = training_pairs(task, tokenizer, problems)
    assert len(prompts) == len(targets) == 2 * len(problems)
    assert all(t[-1] == tokenizer.eos_token_id for t in targets)
    assert [tokenizer.decode(t[:-1]).startswith("<tool_call>") for t in targets] == [True, False] * len(problems)


def test_an_environment_without_the_calculator_is_refused_by_name(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    task = words_tools(tmp_path, entry="tests.envs.tool_classes:Calculator")  # add and divide
    with pytest.raises(DatasetError, match=r"'calculate' tool .*tests\.envs\.tool_classes:Calculator.*model_dir"):
        training_pairs(task, tokenizer, task.problems("train")[:1])


def scripted(tokenizer: PreTrainedTokenizerFast, task: MultiTurnTask, plans: dict[str, list[str]]) -> Sampler:
    """A sampler that plays each problem's planned turns (by the problem found in the prompt, the turn by how
    many the prompt holds), each ended by the end-of-turn token unless it is marked ``cut:`` or runs past
    ``max_new_tokens`` (then cut there, as sampling cuts it)."""
    by_prompt = {p.prompt: p.prompt_id for p in task.problems("heldout")}

    def sampler(prompts: list[list[int]], max_new_tokens: int) -> Samples:
        out, cut = [], []
        for ids in prompts:
            text = tokenizer.decode(ids)
            (problem_id,) = [pid for prompt, pid in by_prompt.items() if prompt in text]
            turn = plans[problem_id][text.count("<|im_start|>assistant") - 1]
            ids = tokenizer.encode(turn.removeprefix("cut:"), add_special_tokens=False)
            if not turn.startswith("cut:"):
                ids.append(tokenizer.eos_token_id)
            out.append(ids[:max_new_tokens])
            cut.append(out[-1][-1] != tokenizer.eos_token_id)
        return Samples(completions=out, logprobs=[[0.0] * len(c) for c in out], truncated=cut)

    return sampler


def call(expression: str) -> str:
    return f'<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


def own_tokenizer(task: MultiTurnTask) -> PreTrainedTokenizerFast:
    """The tokenizer the warm start trains for ``task``: its tool calls fit a turn's token limit."""
    return tokenizer_for(task, tiny_model_settings(task.settings)[0])


@pytest.mark.parametrize("cut_turn", ["end", "continue"])
def test_the_probe_plays_whole_episodes_and_scores_their_final_turns(tmp_path: Path, cut_turn: str) -> None:
    task = words_tools(tmp_path, cut_turn=cut_turn)
    tokenizer = own_tokenizer(task)
    problems: list[Problem] = list(task.problems("heldout"))
    assert len(problems) == 6
    rows = {json.loads(line)["id"]: json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()}
    plans: dict[str, list[str]] = {}
    for i, p in enumerate(problems):
        right, expression = p.reference, words.solution_expression(rows[p.prompt_id]["solution"])
        plans[p.prompt_id] = [
            [call(expression), f"\\boxed{{{right}}}"],  # the demonstration: right, 2 turns
            [call(expression), f"\\boxed{{{int(right) + 1}}}"],  # copies the tool's answer wrong: 2 turns
            [f"\\boxed{{{right}}}"],  # answers at once, right: 1 turn
            ["<tool_call>{oops</tool_call>", call(expression), f"\\boxed{{{right}}}"],  # repairs a bad call: 3 turns
            [call(expression), call(expression), call(expression)],  # never answers: 3 turns, scored 0
            ["cut:<tool_call>\n{", f"\\boxed{{{right}}}"],  # cut mid-call: ends there, or goes on to answer right
        ][i]
    model = build_model(ModelSpec(max_position_embeddings=512), tokenizer)  # unused: the plans sample
    rates = episode_pass_rate(model, tokenizer, task, problems, 2, sampler=scripted(tokenizer, task, plans))
    assert rates.num_prompts == 6 and rates.num_samples == 12
    last = 2 if cut_turn == "continue" else 1
    assert rates.pass_rate == pytest.approx((1 + 0 + 1 + 1 + 0 + (last == 2)) / 6)
    assert rates.mean_turns == pytest.approx((2 + 2 + 1 + 3 + 3 + last) / 6)
    assert rates.truncation_rate == pytest.approx(2 / (2 * (11 + last)))


def test_the_episode_token_limit_ends_an_episode(tmp_path: Path) -> None:
    task = words_tools(tmp_path, max_episode_tokens=20)
    tokenizer = own_tokenizer(task)
    problems = list(task.problems("heldout"))[:1]
    long_call = call(" + ".join(["1"] * 12))
    assert len(tokenizer.encode(long_call, add_special_tokens=False)) >= 20
    plans = {problems[0].prompt_id: [long_call, f"\\boxed{{{problems[0].reference}}}"]}
    model = build_model(ModelSpec(max_position_embeddings=512), tokenizer)
    rates = episode_pass_rate(model, tokenizer, task, problems, 1, sampler=scripted(tokenizer, task, plans))
    assert rates.mean_turns == 1 and rates.pass_rate == 0.0  # no room for the answer
    assert rates.truncation_rate == 1.0  # cut at the episode's 20 tokens


def test_the_tiny_model_for_a_multiturn_task(tmp_path: Path) -> None:
    task = words_tools(tmp_path)
    spec, _ = tiny_model_settings(task.settings)
    assert spec.max_position_embeddings == 512 and spec.family == "qwen3"
    tok = tokenizer_for(task, spec)
    assert len(tok) == MULTITURN_BPE_VOCAB_SIZE
    texts = tokenizer_texts(task)
    assert len(texts) == 24 and all("<tools>" in t and "\\boxed{" in t for t in texts)
    # What shapes the model is in the key; how generators host episodes is not.
    settings, ws = task.settings, tiny_model_settings(task.settings)[1]
    env = settings.environment
    hosted = settings.model_copy(update={"environment": env.model_copy(update={"num_workers": 2})})
    limited = settings.model_copy(update={"environment": env.model_copy(update={"max_turns": 5})})
    assert cache_key(spec, hosted, ws) == cache_key(spec, settings, ws)
    assert cache_key(spec, limited, ws) != cache_key(spec, settings, ws)
    assert isinstance(settings, MultiTurnSettings)
