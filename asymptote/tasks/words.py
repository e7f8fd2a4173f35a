"""The embedded word-problem dataset: generated problems that take two or three steps of arithmetic.

Owns the problems' templates, their worked solutions and the deterministic
generation of the shipped files (``data/words/train.jsonl`` and
``data/words/heldout.jsonl``; ``scripts/gen_word_problems.py`` writes
them). Rows have the dataset task's default fields (``prompt``, ``answer``,
``id``) plus ``solution``, the worked steps a warm start imitates inside
``<think>``. Answers are non-negative integers; every intermediate result
is too. The same seed gives the same bytes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

SOLUTION_FIELD = "solution"
"""The field with a row's worked steps: what a warm start on a dataset imitates inside ``<think>``."""
SEED = 0
NUM_TRAIN = 3000
NUM_HELDOUT = 200
DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "words"
FILES = {"train": "train.jsonl", "heldout": "heldout.jsonl"}

_NAMES = ("Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "June", "Kai", "Lena")
_THINGS = ("apples", "books", "coins", "eggs", "marbles", "pencils", "stamps", "tickets", "shells", "cards")

Row = dict[str, object]
"""prompt, answer (int), solution, without id."""


def _give_then_buy(rng: random.Random) -> Row:
    a, c, d = rng.randint(4, 15), rng.randint(2, 4), rng.randint(2, 5)
    b = rng.randint(1, a - 1)
    name, other, thing = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_THINGS)
    left, bought = a - b, c * d
    return {
        "prompt": f"{name} has {a} {thing} and gives {b} to {other}. Then {name} buys {c} bags with {d} {thing} "
        f"in each bag. How many {thing} does {name} have now?",
        "answer": left + bought,
        "solution": f"{a} - {b} = {left}. {c} * {d} = {bought}. {left} + {bought} = {left + bought}.",
    }


def _boxes_then_lose(rng: random.Random) -> Row:
    c, d = rng.randint(2, 5), rng.randint(2, 5)
    total = c * d
    lost = rng.randint(1, total - 1)
    found = rng.randint(1, 9)
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    kept = total - lost
    return {
        "prompt": f"{name} packs {c} boxes of {d} {thing}. {lost} {thing} get lost, then {name} finds {found} "
        f"more. How many {thing} does {name} have?",
        "answer": kept + found,
        "solution": f"{c} * {d} = {total}. {total} - {lost} = {kept}. {kept} + {found} = {kept + found}.",
    }


def _share(rng: random.Random) -> Row:
    k, each = rng.randint(2, 5), rng.randint(2, 6)
    a = rng.randint(2, 20)
    total = k * each
    bought = total - a if total > a else 0
    if bought == 0:
        a = total - rng.randint(1, total - 1)
        bought = total - a
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    return {
        "prompt": f"{name} has {a} {thing} and buys {bought} more, then shares them equally among {k} friends. "
        f"How many {thing} does each friend get?",
        "answer": each,
        "solution": f"{a} + {bought} = {total}. {total} / {k} = {each}.",
    }


def _two_friends(rng: random.Random) -> Row:
    a, b = rng.randint(2, 12), rng.randint(2, 3)
    more = a * b
    c = rng.randint(1, min(9, more - 1))
    name, other, thing = rng.choice(_NAMES), rng.choice(_NAMES), rng.choice(_THINGS)
    return {
        "prompt": f"{name} has {a} {thing}. {other} has {b} times as many, and gives away {c}. "
        f"How many {thing} do {name} and {other} have together?",
        "answer": a + more - c,
        "solution": f"{a} * {b} = {more}. {more} - {c} = {more - c}. {a} + {more - c} = {a + more - c}.",
    }


TEMPLATES: tuple[Callable[[random.Random], Row], ...] = (_give_then_buy, _boxes_then_lose, _share, _two_friends)


def generate(num_train: int = NUM_TRAIN, num_heldout: int = NUM_HELDOUT, seed: int = SEED) -> dict[str, list[Row]]:
    """The train and held-out rows, with ids; no prompt appears twice (in a split or across them)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[Row] = []
    while len(rows) < num_train + num_heldout:
        row = rng.choice(TEMPLATES)(rng)
        if row["prompt"] in seen:
            continue
        seen.add(str(row["prompt"]))
        rows.append({"id": f"w{len(rows):05d}", **row})
    return {"train": rows[:num_train], "heldout": rows[num_train:]}


def render(rows: list[Row]) -> str:
    """The jsonl text of ``rows``: one compact object per line, keys in a fixed order."""
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)


def write(out_dir: Path = DATA_DIR, seed: int = SEED) -> dict[str, Path]:
    """Write the generated files into ``out_dir``; their paths by split."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in generate(seed=seed).items():
        paths[split] = out_dir / FILES[split]
        paths[split].write_text(render(rows))
    return paths


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def solution_expression(solution: str) -> str:
    """One arithmetic expression for a row's worked steps, e.g. ``"4 * 3 - 4 + 6"`` for ``"4 * 3 = 12.
    12 - 4 = 8. 8 + 6 = 14."``: each earlier result an operand stands for is replaced by the expression that
    gave it, with the parentheses precedence needs. Its value is the last step's result whatever the
    replacements (each replaces a number by an expression of equal value). Every result but the last is
    used once; an operand equal to an earlier result is taken for it from the last step back, so that a
    problem's own number keeps its place in an earlier step. ValueError for text that is not
    ``a op b = c.`` steps.
    """
    steps: list[tuple[str, str, str, str]] = []
    for part in solution.strip().removesuffix(".").split(". "):
        lhs, _, result = part.partition(" = ")
        operands = lhs.split(" ")
        if len(operands) != 3 or operands[1] not in _PRECEDENCE or not result:
            raise ValueError(f"not a worked step 'a op b = c': {part!r}")
        steps.append((operands[0], operands[1], operands[2], result))
    source: dict[tuple[int, int], int] = {}  # (step, operand 0 or 2) -> the earlier step whose result it is
    used: set[int] = set()
    for j in range(len(steps) - 1, -1, -1):
        for k in (0, 2):
            earlier = [i for i in range(j) if i not in used and steps[i][3] == steps[j][k]]
            if earlier:
                source[(j, k)] = earlier[-1]
                used.add(earlier[-1])
    built: list[tuple[str, int]] = []  # each step's expression and its operator's precedence
    for j, (a, op, b, _) in enumerate(steps):
        prec = _PRECEDENCE[op]
        left, left_prec = built[source[(j, 0)]] if (j, 0) in source else (a, 3)
        right, right_prec = built[source[(j, 2)]] if (j, 2) in source else (b, 3)
        if left_prec < prec:
            left = f"({left})"
        if right_prec < prec or (right_prec == prec and op in "-/"):
            right = f"({right})"
        built.append((f"{left} {op} {right}", prec))
    return built[-1][0]
