"""The embedded word-problem dataset: the shipped files are the generator's output, and every row is right."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

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
