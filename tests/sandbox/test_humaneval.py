"""HumanEval's canonical solutions in the sandbox: those that pass outside it pass inside (all 164 here),
and each with an off-by-one injected into its return value fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asymptote.tasks.code import code_tests, fenced, gold_program, humaneval_rows
from asymptote.tasks.verifiers import CodeSettings
from asymptote.tasks.verifiers.code import CodeVerifier

pytestmark = pytest.mark.slow

OFF_BY_ONE = """

def _off_by_one(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, (list, tuple)):
        return type(value)([*value, 0])
    return [value]

_original = {name}

def {name}(*args, **kwargs):
    return _off_by_one(_original(*args, **kwargs))
"""


def passes_outside(program: str) -> bool:
    done = subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, timeout=30)
    return done.returncode == 0


def test_canonical_solutions_pass_and_off_by_one_fails() -> None:
    rows = humaneval_rows()
    assert len(rows) == 164
    verifier = CodeVerifier(CodeSettings())
    inside, outside, perturbed_passed = set(), set(), []
    for row in rows:
        gold = gold_program(row, "humaneval")
        assert gold is not None
        tests = code_tests(row, "humaneval")
        if verifier.verdict(fenced(gold), tests.model_dump_json()).correct:
            inside.add(row["task_id"])
        if passes_outside(f"{gold}\n{row['test']}\ncheck({row['entry_point']})\n"):
            outside.add(row["task_id"])
        broken = gold + OFF_BY_ONE.format(name=row["entry_point"])
        if verifier.verdict(fenced(broken), tests.model_dump_json()).correct:
            perturbed_passed.append(row["task_id"])
    assert inside == outside
    assert len(inside) == 164
    assert perturbed_passed == []
