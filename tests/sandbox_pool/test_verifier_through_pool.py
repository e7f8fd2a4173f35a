"""The code verifier gives the same verdicts through the sandbox pool as with the local sandbox.

Directly (``CodeVerifier`` with ``sandbox.pool`` set) and the way a
generator scores (``ScoringPool`` worker processes, the settings with the
pool put in by ``with_pool``), on every kind of test and outcome.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from pool_process import PoolProcess, running_pool

from asymptote.sandbox import SandboxSettings, with_pool
from asymptote.tasks.verifiers import CodeSettings
from asymptote.tasks.verifiers.code import CodeVerifier
from asymptote.tasks.verifiers.pool import ScoringPool

SETTINGS = CodeSettings(test_timeout_s=1.0, program_timeout_s=3.0, memory_mib=512)


def fenced(program: str) -> str:
    return f"Here it is.\n```python\n{program}\n```\n"


STDIO = json.dumps({"kind": "stdio", "cases": [{"input": "3 4\n", "output": "7"}, {"input": "10 -2\n", "output": "8"}]})
CALL = json.dumps(
    {"kind": "call", "fn_name": "add", "cases": [{"args": [1, 2], "expected": 3}, {"args": [5, 5], "expected": 10}]}
)
ASSERT = json.dumps({"kind": "assert", "asserts": ["assert square(3) == 9", "assert square(-2) == 4"]})
CHECK = json.dumps(
    {"kind": "check", "entry_point": "inc", "test": "def check(candidate):\n    assert candidate(1) == 2\n"}
)
CASES: list[tuple[str, str, str, str]] = [
    ("stdio correct", fenced("a, b = map(int, input().split())\nprint(a + b)"), STDIO, "correct"),
    ("stdio wrong", fenced("a, b = map(int, input().split())\nprint(a * b)"), STDIO, "wrong"),
    ("stdio timeout", fenced("while True:\n    pass"), STDIO, "timeout"),
    ("call correct", fenced("def add(a, b):\n    return a + b"), CALL, "correct"),
    ("call wrong", fenced("def add(a, b):\n    return a - b"), CALL, "wrong"),
    ("assert correct", fenced("def square(x):\n    return x * x"), ASSERT, "correct"),
    ("assert crashes", fenced("def square(x):\n    raise SystemExit(1)"), ASSERT, "wrong"),
    ("check correct", fenced("def inc(x):\n    return x + 1"), CHECK, "correct"),
    ("check times out", fenced("def inc(x):\n    while True:\n        pass"), CHECK, "timeout"),
    ("does not compile", fenced("def inc(x) return x"), CHECK, "parse_error"),
    ("no program", "I do not know.", CHECK, "no_answer"),
    ("reads the host", fenced("print(open('/etc/shadow').read())"), STDIO, "wrong"),
]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolProcess]:
    with running_pool(tmp_path_factory.mktemp("pool"), max_concurrent_runs=2) as p:
        yield p


def test_same_verdicts_directly(pool: PoolProcess) -> None:
    local = CodeVerifier(SETTINGS)
    remote = CodeVerifier(with_pool(SETTINGS, pool.client_settings))
    assert remote.settings.sandbox.pool == pool.client_settings
    assert local.settings.sandbox == SandboxSettings()
    got = {name: (local.verdict(c, r).reason, remote.verdict(c, r).reason) for name, c, r, _ in CASES}
    assert got == {name: (want, want) for name, _, _, want in CASES}
    before = pool.sample("asymptote_sandbox_pool_run_seconds_count")
    remote.verdict(CASES[0][1], CASES[0][2])
    assert pool.sample("asymptote_sandbox_pool_run_seconds_count") == before + 2  # one run per stdio case


async def test_same_verdicts_in_scoring_workers(pool: PoolProcess) -> None:
    """The generator's path: the scoring pool's spawned workers build the verifier from the settings."""
    scoring = ScoringPool(with_pool(SETTINGS, pool.client_settings), num_workers=1, timeout_s=30.0)
    try:
        before = pool.sample("asymptote_sandbox_pool_run_seconds_count")
        for name, completion, reference, want in CASES[:6]:
            assert (await scoring.judge(completion, reference)).reason == want, name
        assert pool.sample("asymptote_sandbox_pool_run_seconds_count") > before
    finally:
        scoring.close()
