"""The code verifier over each test format, with hand-written programs, and code datasets at load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asymptote.tasks import DatasetSettings, DatasetTask
from asymptote.tasks.code import code_tests, fenced
from asymptote.tasks.verifiers import CodeSettings, Reason, make_verifier
from asymptote.tasks.verifiers.code import CodeVerifier, extract_program, outputs_match

VERIFIER = make_verifier(CodeSettings(test_timeout_s=2.0, program_timeout_s=6.0))
STDIO = json.dumps({"kind": "stdio", "cases": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4", "output": "6"}]})
CALL = json.dumps(
    {
        "kind": "call",
        "fn_name": "add",
        "cases": [{"args": [1, 2], "expected": 3}, {"args": [[1], [2]], "expected": [1, 2]}],
    }
)
ASSERT = json.dumps(
    {"kind": "assert", "setup": "import math", "asserts": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}
)
CHECK = json.dumps(
    {"kind": "check", "entry_point": "add", "test": "def check(candidate):\n    assert candidate(2, 2) == 4\n"}
)
ADD = "def add(a, b):\n    return a + b\n"
SUM_STDIN = "a, b = map(int, input().split())\nprint(a + b)\n"

CASES: list[tuple[str, str, str, Reason]] = [
    ("stdio right", fenced(SUM_STDIN), STDIO, "correct"),
    ("stdio wrong on one test", fenced("a, b = map(int, input().split())\nprint(a + b + (a > 5))"), STDIO, "wrong"),
    ("stdio crash", fenced("raise SystemExit(3)"), STDIO, "wrong"),
    ("stdio too slow", fenced("while True: pass"), STDIO, "timeout"),
    ("call right", fenced(ADD), CALL, "correct"),
    ("call wrong", fenced("def add(a, b):\n    return 3"), CALL, "wrong"),
    ("call raises", fenced("def add(a, b):\n    raise ValueError"), CALL, "wrong"),
    (
        "call as a Solution method",
        fenced("class Solution:\n    def add(self, a, b):\n        return a + b"),
        CALL,
        "correct",
    ),
    ("call too slow", fenced("def add(a, b):\n    while True: pass"), CALL, "timeout"),
    ("asserts right", fenced(ADD), ASSERT, "correct"),
    ("asserts wrong", fenced("def add(a, b):\n    return a - b"), ASSERT, "wrong"),
    ("asserts dodged by exiting early", fenced(ADD + "import os\nos._exit(0)"), ASSERT, "wrong"),
    ("asserts dodged by printing a fake result", fenced("print('__asymptote_result_0__[]')"), ASSERT, "wrong"),
    ("check right", fenced(ADD), CHECK, "correct"),
    ("check wrong", fenced("def add(a, b):\n    return a * b + 1"), CHECK, "wrong"),
    ("syntax error", fenced("def add(a, b) return"), CHECK, "parse_error"),
    ("no code block", "the answer is a + b", CHECK, "no_answer"),
    ("reasoning never ended", "<think>```python\n" + ADD + "```", CHECK, "no_answer"),
    (
        "last block after </think> wins",
        f"<think>{fenced('x = 1')}</think>{fenced('nope')}\n{fenced(ADD)}",
        CHECK,
        "correct",
    ),
]


@pytest.mark.parametrize(("name", "completion", "reference", "reason"), CASES, ids=[c[0] for c in CASES])
def test_verdicts(name: str, completion: str, reference: str, reason: Reason) -> None:
    verdict = VERIFIER.verdict(completion, VERIFIER.check_reference(reference))
    assert verdict.reason == reason and verdict.correct == (reason == "correct")


def test_extract_program_takes_the_last_python_block() -> None:
    text = "```python\nfirst\n```\n```bash\nls\n```\n```py\nsecond\n```\nthe end"
    assert extract_program(text) == "second\n"
    assert extract_program("```rust\nfn main() {}\n```") is None


def test_outputs_compare_by_tokens_and_numbers() -> None:
    assert outputs_match("1 2\n3  \n", "1 2 3")
    assert outputs_match("0.3333333", "0.33333333", 1e-6)
    assert not outputs_match("1 2", "1 2 3") and not outputs_match("abc", "abd")


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("not json", "code tests"),
        (json.dumps({"kind": "stdio", "cases": []}), "cases"),
        (json.dumps({"kind": "call", "fn_name": "1bad", "cases": [{"args": [], "expected": 1}]}), "fn_name"),
        (json.dumps({"kind": "shell"}), "accepted: JSON with kind stdio"),
    ],
)
def test_malformed_tests_are_refused_with_what_is_accepted(reference: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VERIFIER.check_reference(reference)


LAYOUT_ROWS: list[tuple[str, dict[str, Any], str]] = [
    ("apps", {"input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})}, "stdio"),
    ("taco", {"input_output": {"inputs": [[1, 2]], "outputs": [[3]], "fn_name": "add"}}, "call"),
    (
        "codecontests",
        {
            "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
            "private_tests": {"input": ["2 2\n"], "output": ["4\n"]},
        },
        "stdio",
    ),
    ("deepcoder", {"tests": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}])}, "stdio"),
    (
        "deepcoder",
        {
            "tests": json.dumps([{"input": "[1, 2]", "output": "3", "testtype": "functional"}]),
            "metadata": {"func_name": "add"},
        },
        "call",
    ),
    ("mbpp", {"test_list": ["assert add(1, 2) == 3"], "test_setup_code": ""}, "assert"),
    ("humaneval", {"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"}, "check"),
]


@pytest.mark.parametrize(("layout", "row", "kind"), LAYOUT_ROWS, ids=[f"{r[0]}-{r[2]}" for r in LAYOUT_ROWS])
def test_layouts_read_their_tests(layout: Any, row: dict[str, Any], kind: str) -> None:
    tests = code_tests(row, layout)
    assert tests.kind == kind
    program = ADD if kind != "stdio" else SUM_STDIN
    assert VERIFIER.verdict(fenced(program), tests.model_dump_json()).correct


@pytest.mark.parametrize(
    ("layout", "row", "message"),
    [
        ("apps", {"input_output": "{oops"}, "not JSON"),
        ("apps", {"input_output": json.dumps({"inputs": ["1"], "outputs": []})}, "1 inputs but 0 outputs"),
        ("apps", {"input_output": b"\x80\x04pickle"}, "pickled tests"),
        ("mbpp", {"test_list": []}, "non-empty list"),
        ("humaneval", {"test": "assert True", "entry_point": "f"}, "check"),
        ("deepcoder", {"tests": json.dumps([{"input": "[1]", "output": "1", "testtype": "functional"}])}, "func_name"),
    ],
)
def test_malformed_rows_say_what_is_wrong(layout: Any, row: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        code_tests(row, layout)


def _mbpp_rows() -> list[dict[str, Any]]:
    return [
        {"task_id": 1, "text": "Add two numbers.", "code": ADD, "test_list": ["assert add(1, 2) == 3"]},
        {
            "task_id": 2,
            "text": "Subtract.",
            "code": "def sub(a, b):\n    return a + b\n",
            "test_list": ["assert sub(3, 1) == 2"],
        },  # its gold fails its own test
        {
            "task_id": 3,
            "text": "Double.",
            "code": "def dbl(a):\n    return 2 * a\n",
            "test_list": ["assert dbl(2) == 4"],
        },
        {"task_id": 4, "text": "No tests.", "code": ADD, "test_list": []},
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_code_dataset_counts_failing_gold_as_bad_rows(tmp_path: Path, suffix: str) -> None:
    rows = _mbpp_rows()
    path = tmp_path / f"mbpp{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    task = DatasetTask(DatasetSettings(path=path, preset="mbpp", holdout_fraction=0.4))
    loaded = sorted(p.prompt_id for p in [*task.problems("train"), *task.problems("heldout")])
    assert loaded == ["1", "3"]
    report = task.reports["train"]
    assert report.bad == {"gold_fails": 1, "bad_answer": 1}
    assert isinstance(task.verifier, CodeVerifier)


def test_code_preset_refuses_another_verifier(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs verifier"):
        DatasetSettings.model_validate(
            {"path": str(tmp_path), "preset": "mbpp", "holdout_fraction": 0.1, "verifier": {"kind": "exact"}}
        )


def test_cli_selftest_and_exec(tmp_path: Path) -> None:
    program = tmp_path / "p.py"
    program.write_text("import sys\nprint(sys.stdin.read().upper())\nraise SystemExit(4)\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("hello")
    cli = [sys.executable, "-m", "services.cli", "sandbox"]
    test = subprocess.run([*cli, "selftest"], capture_output=True, text=True, timeout=60)
    chosen = json.loads(test.stdout)
    assert test.returncode == 0 and chosen["backend"] in ("bubblewrap", "landlock")
    assert all(c["ok"] for c in chosen["tried"][chosen["backend"]])
    run = subprocess.run(
        [*cli, "exec", str(program), "--stdin", str(stdin), "--timeout", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    verdict = json.loads(run.stdout)
    assert (verdict["exit_code"], verdict["stdout"], verdict["killed"]) == (4, "HELLO\n", None)
    assert verdict["backend"] == chosen["backend"] and 0 < verdict["time_s"] < 5
    bad = subprocess.run([*cli, "exec", str(program), "--timeout", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--timeout" in bad.stderr
