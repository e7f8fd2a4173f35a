"""The word problems as a code task: every gold program passes its own test in the sandbox, and the warm
start's target (thinking, then a fenced program that prints the answer) is what the code verifier pays for."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from asymptote.tasks import DatasetTask, Problem, words, words_code
from services.embedded.build import ModelSpec
from services.embedded.warmstart import dataset_format, gold_programs, tokenizer_for
from services.local.workloads import workload_task

NUM_SCORED = 24
"""Problems of each split whose warm-start target is run in the sandbox here (the gold check runs all)."""


def test_programs_are_the_worked_steps_with_named_results() -> None:
    assert words_code.program("8 * 2 = 16. 16 - 5 = 11. 8 + 11 = 19.") == "a = 8 * 2\nb = a - 5\nprint(8 + b)"
    assert words_code.program("13 + 7 = 20. 20 / 5 = 4.") == "a = 13 + 7\nprint(a // 5)"
    # An operand equal to an earlier result names it once per step: 2 + 2 after a step giving 2.
    assert words_code.program("4 * 2 = 8. 8 - 6 = 2. 2 + 2 = 4.") == "a = 4 * 2\nb = a - 6\nprint(b + 2)"
    with pytest.raises(ValueError, match="not 'x op y = z'"):
        words_code.program("8 * 2 is 16.")


def test_rows_are_the_word_problems_in_the_apps_layout() -> None:
    for split, name in words.FILES.items():
        plain = [json.loads(line) for line in (words.DATA_DIR / name).open()]
        code = [json.loads(line) for line in (words_code.DATA_DIR / name).open()]
        assert len(code) == len(plain) == (words.NUM_TRAIN if split == "train" else words.NUM_HELDOUT)
        for p, c in zip(plain, code):
            assert (c["problem_id"], c["question"], c["solution"]) == (p["id"], p["prompt"], p["solution"])
            assert json.loads(c["input_output"]) == {"inputs": [""], "outputs": [f"{p['answer']}\n"]}
            assert json.loads(c["solutions"]) == [words_code.program(p["solution"])]


def test_every_rows_gold_program_prints_its_answer() -> None:
    """All 3,200 rows' programs, run in this process: the generated code of the shipped data (the
    sandbox's own path is the next test's, on the held-out split)."""
    for split, name in words_code.FILES.items():
        for line in (words_code.DATA_DIR / name).open():
            row = json.loads(line)
            (source,) = json.loads(row["solutions"])
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(source, row["problem_id"], "exec"), {})  # the shipped gold program
            assert out.getvalue() == json.loads(row["input_output"])["outputs"][0], (split, row["problem_id"])


@pytest.mark.slow
def test_the_gold_check_runs_each_program_in_the_sandbox() -> None:
    """The held-out split's 200 rows, each program run by the code verifier as the dataset task's gold
    check runs it (the training split's programs are the same code, checked above)."""
    heldout = words_code.DATA_DIR / words_code.FILES["heldout"]
    base = workload_task("words-code")
    # A generous time per test: on a loaded machine a sandbox's start alone has taken two seconds.
    verifier = base.verifier.model_copy(update={"test_timeout_s": 20.0, "program_timeout_s": 20.0})
    settings = {"path": heldout, "eval_path": None, "holdout_fraction": 0.5, "check_gold": True, "verifier": verifier}
    task = DatasetTask(base.model_copy(update=settings))
    assert len(task.problems("train")) + len(task.problems("heldout")) == words.NUM_HELDOUT
    report = task.reports["train"]
    assert report.num_loaded == report.num_rows == words.NUM_HELDOUT and not report.bad, report.summary()


def test_the_warm_start_target_is_paid_by_the_code_verifier_and_nothing_else_is() -> None:
    settings = workload_task("words-code")
    task = DatasetTask(settings)
    fmt = dataset_format(settings, tokenizer_for(task, ModelSpec()))
    programs = gold_programs(settings)
    for split in ("train", "heldout"):
        for problem in list(task.problems(split))[:NUM_SCORED]:
            target = fmt.target(problem)
            assert target.endswith(f"</think>\n\n```python\n{programs[problem.prompt_id]}\n```")
            assert task.score(target, problem.reference) == 1.0, target
    problem: Problem = task.problems("heldout")[0]
    answer = json.loads(problem.reference)["cases"][0]["output"].strip()
    thinking = fmt.target(problem).split("</think>")[0] + "</think>\n\n"
    assert task.score(thinking + f"\\boxed{{{answer}}}", problem.reference) == 0.0  # the words format: no program
    assert task.score(thinking + f"```python\nprint({int(answer) + 1})\n```", problem.reference) == 0.0
    assert task.score(thinking + f"```python\nprint({answer})\n```", problem.reference) == 1.0
    assert task.score(f"```python\nprint({answer})\n```\n<think>", problem.reference) == 0.0  # cut while thinking
