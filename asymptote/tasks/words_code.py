"""The embedded word problems as a code task: answered by a short Python program that prints the answer.

Owns turning the word problems (asymptote/tasks/words.py) into rows of the
APPS layout (``preset: apps``): ``problem_id``, ``question`` (the word
problem), ``input_output`` (one stdin/stdout test: no input, the answer
printed), ``solutions`` (the gold program) and ``solution`` (the worked
steps a warm start imitates inside ``<think>``), written to
``data/words-code/`` by ``scripts/gen_word_problems.py``. The gold program
names each step's result and prints the last one::

    a = 8 * 2
    b = a - 5
    print(8 + b)

The code verifier runs a completion's program in the sandbox and compares
what it prints with the answer; the same rows, ids and splits as the word
problems, so a mixture of both asks the same questions in two formats.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from asymptote.tasks import words

DATA_DIR = words.DATA_DIR.parent / "words-code"
FILES = words.FILES
INSTRUCTION = "Answer with a Python program that prints the number."
"""What a words-code prompt asks for after the problem (the workload's ``prompt_format``): in a mixture
with the word problems, it is what tells the two formats apart."""
PROMPT_FORMAT = "{prompt} " + INSTRUCTION

_STEP = re.compile(r"^(\d+) ([-+*/]) (\d+) = (\d+)$")
_VARIABLES = "abcdefgh"


def program(solution: str) -> str:
    """The gold program of a worked solution ("8 * 2 = 16. 16 - 5 = 11. 8 + 11 = 19."): one assignment per
    step but the last, which is printed; an operand equal to an earlier step's result is that step's
    variable (once per step: "2 + 2" after a step giving 2 is "b + 2"). ValueError for a step that is not ``x op y = z`` with non-negative integers."""
    steps = [s for s in solution.strip().removesuffix(".").split(". ") if s]
    results: dict[str, str] = {}
    lines = []
    for i, step in enumerate(steps):
        match = _STEP.match(step)
        if match is None:
            raise ValueError(f"step {step!r} is not 'x op y = z'")
        left, op, right, value = match.groups()
        left_name = results.get(left, left)
        right_name = right if left_name != left and left == right else results.get(right, right)
        expression = f"{left_name} {'//' if op == '/' else op} {right_name}"
        if i == len(steps) - 1:
            lines.append(f"print({expression})")
        else:
            name = _VARIABLES[i]
            lines.append(f"{name} = {expression}")
            results[value] = name
    return "\n".join(lines)


def code_row(row: words.Row) -> words.Row:
    """A word-problem row (with its id) in the APPS layout."""
    solution = str(row["solution"])
    return {
        "problem_id": row["id"],
        "question": row["prompt"],
        "input_output": json.dumps({"inputs": [""], "outputs": [f"{row['answer']}\n"]}),
        "solutions": json.dumps([program(solution)]),
        words.SOLUTION_FIELD: solution,
    }


def write(out_dir: Path = DATA_DIR, seed: int = words.SEED) -> dict[str, Path]:
    """Write the code rows of the generated word problems into ``out_dir``; their paths by split."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in words.generate(seed=seed).items():
        paths[split] = out_dir / FILES[split]
        paths[split].write_text(words.render([code_row(r) for r in rows]))
    return paths
