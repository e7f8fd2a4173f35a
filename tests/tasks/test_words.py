"""The embedded word-problem dataset: the shipped files are the generator's output, and every row is right."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asymptote.tasks import DatasetSettings, DatasetTask, words, words_code
from asymptote.tasks.verifiers import MathSettings, make_verifier

REPO = Path(__file__).resolve().parents[2]


def test_shipped_files_are_the_scripts_output(tmp_path: Path) -> None:
    out, code = tmp_path / "words", tmp_path / "words-code"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_word_problems.py"), "--out", str(out), "--code-out", str(code)],
        capture_output=True,
        check=True,
    )
    for folder, shipped in ((out, words.DATA_DIR), (code, words_code.DATA_DIR)):
        assert sorted(p.name for p in folder.iterdir()) == sorted(words.FILES.values())
        for name in words.FILES.values():
            assert (folder / name).read_bytes() == (shipped / name).read_bytes(), f"{shipped / name} differs"


def test_another_seed_gives_other_problems() -> None:
    a, b = words.generate(50, 10, seed=0), words.generate(50, 10, seed=1)
    assert [r["prompt"] for r in a["train"]] != [r["prompt"] for r in b["train"]]
    assert words.generate(50, 10, seed=0) == a


def test_rows_are_integer_answers_with_worked_steps_that_compute_them() -> None:
    rows = [json.loads(line) for name in words.FILES.values() for line in (words.DATA_DIR / name).open()]
    assert len(rows) == words.NUM_TRAIN + words.NUM_HELDOUT
    assert len({r["id"] for r in rows}) == len(rows) and len({r["prompt"] for r in rows}) == len(rows)
    assert {tuple(r) for r in rows} == {("id", "prompt", "answer", "solution")}
    step = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)\.")
    for r in rows:
        assert isinstance(r["answer"], int) and r["answer"] >= 0
        steps = step.findall(r["solution"])
        assert 2 <= len(steps) <= 3 and " ".join(f"{a} {op} {b} = {c}." for a, op, b, c in steps) == r["solution"]
        for a, op, b, c in steps:
            value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b), "/": int(a) / int(b)}[op]
            assert value == int(c), r
        assert int(steps[-1][3]) == r["answer"]
    # Every template is used, in roughly equal shares.
    shares = [sum(1 for r in rows if r["solution"].count("=") == n) for n in (2, 3)]
    assert shares[0] > 0.15 * len(rows) and shares[1] > 0.6 * len(rows)


def test_the_dataset_task_reads_them_and_math_verify_scores_the_thinking_format() -> None:
    task = DatasetTask(DatasetSettings(path=words.DATA_DIR / "train.jsonl", eval_path=words.DATA_DIR / "heldout.jsonl"))
    train, heldout = task.problems("train"), task.problems("heldout")
    assert (len(train), len(heldout)) == (words.NUM_TRAIN, words.NUM_HELDOUT)
    assert task.reports["train"].num_bad == 0 and task.reports["heldout"].num_bad == 0
    first = train[0]
    assert first.prompt_id == "w00000"
    verifier = make_verifier(MathSettings())
    right = f"<think>\nworking\n</think>\n\n\\boxed{{{first.reference}}}"
    wrong = f"<think>\n\\boxed{{{first.reference}}}\n</think>\n\n\\boxed{{{int(first.reference) + 1}}}"
    assert task.score(right, first.reference) == 1.0
    assert task.score(wrong, first.reference) == 0.0  # the answer counts, not the thinking
    assert verifier.verdict(f"{first.reference}", first.reference).reason != "correct"  # unboxed is not an answer


def test_every_rows_expression_is_worth_its_answer_by_the_calculator() -> None:
    from asymptote.envs.calculator import evaluate, shown

    rows = [json.loads(line) for name in words.FILES.values() for line in (words.DATA_DIR / name).open()]
    for row in rows:
        expression = words.solution_expression(row["solution"])
        assert shown(evaluate(expression)) == str(row["answer"]), (row, expression)
        # Each problem number appears in it once per step that uses it: no result is left as a number.
        steps = row["solution"].removesuffix(".").split(". ")
        assert len(re.findall(r"\d+", expression)) == 2 * len(steps) - (len(steps) - 1), (row, expression)


@pytest.mark.parametrize(
    ("solution", "expression"),
    [
        ("4 * 3 = 12. 12 - 4 = 8. 8 + 6 = 14.", "4 * 3 - 4 + 6"),
        ("6 + 6 = 12. 12 / 4 = 3.", "(6 + 6) / 4"),
        ("2 + 3 = 5. 9 - 5 = 4.", "9 - (2 + 3)"),
        ("8 - 2 = 6. 12 / 6 = 2.", "12 / (8 - 2)"),
        ("6 / 2 = 3. 9 / 3 = 3.", "9 / (6 / 2)"),
        ("2 * 3 = 6. 6 * 4 = 24.", "2 * 3 * 4"),
        # 4 is both step 1's result and a number of the problem: the last step takes the result, step 2 the number.
        ("5 - 1 = 4. 4 * 3 = 12. 4 + 12 = 16.", "5 - 1 + 4 * 3"),
        ("7 + 1 = 8.", "7 + 1"),
    ],
)
def test_the_expression_keeps_precedence_and_the_problems_numbers(solution: str, expression: str) -> None:
    from asymptote.envs.calculator import evaluate

    assert words.solution_expression(solution) == expression
    assert evaluate(expression) == float(solution.removesuffix(".").rsplit(" = ", 1)[1])


@pytest.mark.parametrize("solution", ["", "12.", "4 x 3 = 12.", "4 * 3 is 12.", "4 * = 12."])
def test_text_that_is_not_worked_steps_is_refused(solution: str) -> None:
    with pytest.raises(ValueError, match="not a worked step"):
        words.solution_expression(solution)


def test_math_verify_s_disabled_timeout_warning_is_not_printed() -> None:
    # Its time limits are off on purpose (the scoring pool's kill is the limit): without the guard the parser
    # and the grader each log "Timeout is disabled" at a generator's start.
    import subprocess
    import sys

    code = (
        "import logging; logging.basicConfig(level='INFO')\n"
        "from asymptote.tasks.verifiers.math import MathSettings, MathVerifier\n"
        "print(MathVerifier(MathSettings()).verdict('<think>x</think> \\\\boxed{2}', '2').correct)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "True"
    assert "Timeout is disabled" not in done.stderr, done.stderr
