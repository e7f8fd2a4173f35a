"""Code answers, judged by running them in the sandbox against the row's tests.

Owns the tests a code reference holds (``CodeTests``: stdin/stdout pairs,
function calls, asserts, or a HumanEval ``check(candidate)``), taking the
program out of a completion (the last fenced code block after the
reasoning section; none is ``no_answer``), the harness each kind of test
runs in, and comparing what came back. A reference is the tests as JSON
(``CodeTests.model_dump_json``); dataset rows in their own layouts become
one in asymptote/tasks/code.py.

Reward 1 only when every test passes. Each test has its own time limit
(``test_timeout_s``), the whole program one more (``program_timeout_s``),
and output is capped. Stdin/stdout tests run the program once per test
and compare outside the sandbox; function-call tests run all calls in one
process and print only the return values, compared outside, so the
expected values never enter the sandbox. Assert and ``check`` tests run
inside the program's own process (the asserts hold the expected values):
a program that reads its harness could forge the result line, which a
random marker per run makes harder but not impossible.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from asymptote.config import Frozen
from asymptote.sandbox import Limits, RunResult, Sandbox, SandboxSettings, sandbox_for
from asymptote.tasks.verifiers.base import CORRECT, NO_ANSWER, PARSE_ERROR, WRONG, Verdict, strip_think

TIMEOUT = Verdict(False, "timeout")
ERROR = Verdict(False, "error")


class CodeSettings(Frozen):
    """Run the completion's program against the reference's tests in the sandbox."""

    kind: Literal["code"] = "code"
    """Verifier kind."""
    test_timeout_s: float = Field(default=4.0, gt=0.0)
    """Wall-clock limit of one test (one run for stdin/stdout, one call or assert otherwise)."""
    program_timeout_s: float = Field(default=20.0, gt=0.0)
    """Wall-clock limit of all of a program's tests together; past it the verdict is timeout."""
    memory_mib: int = Field(default=1024, ge=64)
    """Address space of the program, in MiB."""
    max_output_bytes: int = Field(default=1 << 20, ge=1024)
    """Output one run may write; more is killed and wrong."""
    float_tolerance: float = Field(default=1e-6, ge=0.0)
    """Stdin/stdout tests: numbers equal within this (absolute or relative) count as equal."""
    sandbox: SandboxSettings = SandboxSettings()
    """Which sandbox runs programs (chosen by its self-test at first use)."""


class StdioCase(BaseModel):
    input: str
    output: str


class StdioTests(BaseModel):
    """Programs that read stdin and print (APPS, TACO, CodeContests, DeepCoder's stdin tests)."""

    kind: Literal["stdio"] = "stdio"
    cases: list[StdioCase] = Field(min_length=1)


class CallCase(BaseModel):
    args: list[Any]
    expected: Any


class CallTests(BaseModel):
    """A function (or a method of ``class Solution``) called with arguments (APPS's ``fn_name``)."""

    kind: Literal["call"] = "call"
    fn_name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    cases: list[CallCase] = Field(min_length=1)


class AssertTests(BaseModel):
    """Assert statements run after the program (MBPP's ``test_list`` and ``test_setup_code``)."""

    kind: Literal["assert"] = "assert"
    setup: str = ""
    asserts: list[str] = Field(min_length=1)


class CheckTests(BaseModel):
    """HumanEval: a ``check(candidate)`` function called with the entry point."""

    kind: Literal["check"] = "check"
    test: str = Field(min_length=1)
    entry_point: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")


CodeTests = Annotated[StdioTests | CallTests | AssertTests | CheckTests, Field(discriminator="kind")]
TESTS: TypeAdapter[StdioTests | CallTests | AssertTests | CheckTests] = TypeAdapter(CodeTests)


def parse_tests(reference: str) -> StdioTests | CallTests | AssertTests | CheckTests:
    """The tests a reference holds; ValueError saying what is wrong and what is accepted."""
    try:
        return TESTS.validate_json(reference)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "reference"
        raise ValueError(
            f"code tests {where}: {first['msg']} (accepted: JSON with kind stdio {{cases: [{{input, output}}]}}, "
            "call {fn_name, cases: [{args, expected}]}, assert {asserts, setup} or check {test, entry_point})"
        ) from None


_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_TAGS = ("", "python", "py", "python3")


def extract_program(completion: str) -> str | None:
    """The last fenced Python (or untagged) code block after the reasoning section; None without one."""
    text = strip_think(completion)
    if text is None:
        return None
    blocks = [body for tag, body in _FENCE.findall(text) if tag.lower() in PYTHON_TAGS]
    if not blocks or not blocks[-1].strip():
        return None
    return str(blocks[-1])


def _number(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def outputs_match(got: str, want: str, tolerance: float = 1e-6) -> bool:
    """Whitespace-separated tokens equal, numbers within ``tolerance`` (absolute or relative)."""
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        nx, ny = _number(x), _number(y)
        if nx is None or ny is None or not math.isclose(nx, ny, rel_tol=tolerance, abs_tol=tolerance):
            return False
    return True


def _normal(value: Any) -> Any:
    """A value as JSON would carry it (tuples become lists), so both sides compare alike."""
    return json.loads(json.dumps(value, default=repr))


def call_matches(got: Any, want: Any) -> bool:
    """APPS's rule: equal, or equal to the only element of a one-element expected list."""
    got, want = _normal(got), _normal(want)
    return bool(got == want or (isinstance(want, list) and len(want) == 1 and got == want[0]))


_TIMER = """
import signal as _sig
class _TestTimeout(BaseException):
    pass
def _alarm(*_):
    raise _TestTimeout()
_sig.signal(_sig.SIGALRM, _alarm)
"""


def _each_test(items: str, run: str, caught: str, marker: str, test_timeout_s: float, dumps: str = "") -> str:
    """The harness's loop: ``run`` (a statement appending ``["ok", value]``) for each of ``items``, a
    timer per test, stopping at the first timeout or ``caught`` exception; then the results as JSON
    after ``marker`` on a line of their own."""
    return f"""_out = []
for _item in {items}:
    _sig.setitimer(_sig.ITIMER_REAL, {test_timeout_s!r})
    try:
        {run}
    except _TestTimeout:
        _out.append(["timeout", None])
        break
    except {caught} as _e:
        _out.append(["error", repr(_e)[:200]])
        break
    finally:
        _sig.setitimer(_sig.ITIMER_REAL, 0)
_sys.stdout.flush()
print("\\n{marker}" + _json.dumps(_out{dumps}))
"""


def call_harness(program: str, tests: CallTests, marker: str, test_timeout_s: float) -> str:
    return f"""{program}

{_TIMER}
import json as _json, sys as _sys
def _target():
    if "Solution" in globals() and hasattr(globals()["Solution"], {tests.fn_name!r}):
        return getattr(globals()["Solution"](), {tests.fn_name!r})
    return globals()[{tests.fn_name!r}]
""" + _each_test(
        "_json.loads(_sys.stdin.read())",
        '_out.append(["ok", _target()(*_item)])',
        "Exception",
        marker,
        test_timeout_s,
        ", default=repr",
    )


def assert_harness(program: str, tests: AssertTests | CheckTests, marker: str, test_timeout_s: float) -> str:
    if isinstance(tests, CheckTests):
        setup, checks = "", [f"{tests.test}\ncheck({tests.entry_point})"]
    else:
        setup, checks = tests.setup, tests.asserts
    return f"""{setup}
{program}

{_TIMER}
import json as _json, sys as _sys
""" + _each_test(
        repr(checks),
        'exec(compile(_item, "<test>", "exec"), globals()); _out.append(["ok", None])',
        "BaseException",
        marker,
        test_timeout_s,
    )


class CodeVerifier:
    """Checks a completion's program against code tests; the sandbox is chosen on first use."""

    def __init__(self, settings: CodeSettings | None = None, sandbox: Sandbox | None = None) -> None:
        self.settings = settings or CodeSettings()
        self._sandbox = sandbox

    @property
    def sandbox(self) -> Sandbox:
        """The sandbox programs run in; SandboxUnavailable when no backend passes its self-test."""
        if self._sandbox is None:
            self._sandbox = sandbox_for(self.settings.sandbox)
        return self._sandbox

    def check_reference(self, reference: str) -> str:
        return parse_tests(reference).model_dump_json()

    def verdict(self, completion: str, reference: str) -> Verdict:
        program = extract_program(completion)
        if program is None:
            return NO_ANSWER
        return self.run_tests(program, reference)

    def run_tests(self, program: str, reference: str) -> Verdict:
        """The verdict on ``program`` (source, already extracted) against the tests in ``reference``."""
        try:
            tests = parse_tests(reference)
        except ValueError:
            return PARSE_ERROR
        try:
            compile(program, "<program>", "exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            return PARSE_ERROR
        if isinstance(tests, StdioTests):
            return self._stdio(program, tests)
        return self._harnessed(program, tests)

    def _limits(self, timeout_s: float) -> Limits:
        s = self.settings
        return Limits(timeout_s=timeout_s, memory_mib=s.memory_mib, output_bytes=s.max_output_bytes)

    def _stdio(self, program: str, tests: StdioTests) -> Verdict:
        deadline = time.monotonic() + self.settings.program_timeout_s
        for case in tests.cases:
            left = deadline - time.monotonic()
            if left <= 0:
                return TIMEOUT
            limited = left < self.settings.test_timeout_s
            result = self.sandbox.run(
                program, case.input.encode(), self._limits(min(left, self.settings.test_timeout_s))
            )
            if result.killed == "timeout":
                return TIMEOUT
            if not result.ok:
                return WRONG
            got = result.stdout.decode("utf-8", "replace")
            if not outputs_match(got, case.output, self.settings.float_tolerance):
                return WRONG
            if limited and time.monotonic() >= deadline:
                return TIMEOUT
        return CORRECT

    def _harnessed(self, program: str, tests: CallTests | AssertTests | CheckTests) -> Verdict:
        s = self.settings
        marker = f"__asymptote_result_{secrets.token_hex(16)}__"
        if isinstance(tests, CallTests):
            source = call_harness(program, tests, marker, s.test_timeout_s)
            stdin = json.dumps([c.args for c in tests.cases]).encode()
            num_tests = len(tests.cases)
        else:
            source = assert_harness(program, tests, marker, s.test_timeout_s)
            stdin = b""
            num_tests = len(tests.asserts) if isinstance(tests, AssertTests) else 1
        # The program's own start-up counts as one more test's worth of time.
        timeout_s = min(s.program_timeout_s, s.test_timeout_s * (num_tests + 1))
        result = self.sandbox.run(source, stdin, self._limits(timeout_s))
        outcomes = _outcomes(result, marker)
        if outcomes is None:
            return TIMEOUT if result.killed == "timeout" else WRONG
        if any(status == "timeout" for status, _ in outcomes):
            return TIMEOUT
        if len(outcomes) != num_tests or any(status != "ok" for status, _ in outcomes):
            return WRONG
        if isinstance(tests, CallTests):
            ok = all(call_matches(got, case.expected) for (_, got), case in zip(outcomes, tests.cases))
            return CORRECT if ok else WRONG
        return CORRECT


def _outcomes(result: RunResult, marker: str) -> list[tuple[str, Any]] | None:
    """The harness's result line, or None when the program never got there (crashed, killed, exited early)."""
    if result.killed is not None or result.exit_code != 0:
        return None
    text = result.stdout.decode("utf-8", "replace")
    at = text.rfind("\n" + marker)
    if at < 0:
        return None
    try:
        found = json.loads(text[at + 1 + len(marker) :].strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(found, list) or not all(isinstance(o, list) and len(o) == 2 for o in found):
        return None
    return [(str(status), value) for status, value in found]
