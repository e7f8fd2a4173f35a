"""The Hermes tool-call parser and the plain-class tool adapter, on exact values."""

from __future__ import annotations

import sys

import pytest

from asymptote.envs.base import EnvTask
from asymptote.envs.tools import ParsedTurn, ToolCall, ToolClassEnvironment, parse_turn, tool_schemas
from tests.envs.tool_classes import Calculator, NoDocstring


def test_a_turn_splits_into_text_and_calls_in_order() -> None:
    turn = (
        "Let me add first.\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 4}"}</tool_call>'
    )
    parsed = parse_turn(turn)
    assert parsed == ParsedTurn(
        "Let me add first.", [ToolCall("add", {"a": 2, "b": 3}), ToolCall("divide", {"a": 1, "b": 4})], []
    )
    assert parsed.message() == {
        "role": "assistant",
        "content": "Let me add first.",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
            {"type": "function", "function": {"name": "divide", "arguments": {"a": 1, "b": 4}}},
        ],
    }


def test_a_turn_without_calls_is_all_text() -> None:
    assert parse_turn("  The answer is 5.\n") == ParsedTurn("  The answer is 5.\n")
    assert parse_turn("The answer is 5.").message() == {"role": "assistant", "content": "The answer is 5."}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            '{"name": "add", "arguments": {"a": 2',
            "a tool call is not valid JSON (Expecting ',' delimiter at character 36)",
        ),
        ('{"arguments": {}}', 'a tool call must be a JSON object with a "name" string'),
        ('["add"]', 'a tool call must be a JSON object with a "name" string'),
        ('{"name": "add", "arguments": [2, 3]}', "the \"arguments\" of tool call 'add' must be a JSON object"),
    ],
)
def test_a_malformed_call_is_reported_not_guessed(body: str, error: str) -> None:
    parsed = parse_turn(f"Hmm <tool_call>{body}</tool_call> ok")
    assert parsed == ParsedTurn("Hmm  ok", [], [error])


def test_a_call_left_open_is_not_executed() -> None:
    parsed = parse_turn('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b"')
    assert parsed == ParsedTurn("Sure.", [], ["a <tool_call> was not closed with </tool_call>"])


def test_tool_schemas_come_from_signatures_hints_and_docstrings() -> None:
    assert tool_schemas(Calculator) == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "integer", "description": "The first addend."},
                        "b": {"type": "integer", "description": "The second addend."},
                    },
                    "required": ["a", "b"],
                    "additionalProperties": False,
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "divide",
                "description": "Divide one number by another.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "number", "description": "The dividend."},
                        "b": {"type": "number", "description": "The divisor."},
                    },
                    "required": ["a", "b"],
                    "additionalProperties": False,
                },
            },
        },
    ]


def test_a_tool_without_a_docstring_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"tool NoDocstring\.add has no docstring"):
        tool_schemas(NoDocstring)

    class Undescribed:
        def add(self, a: int, b: int) -> int:
            """Add.

            Args:
                a: The first addend.
            """
            return a + b

    with pytest.raises(ValueError, match="parameter 'b' is not described in the docstring's Args"):
        tool_schemas(Undescribed)

    class Unhinted:
        def add(self, a, b: int) -> int:  # type: ignore[no-untyped-def]
            """Add.

            Args:
                a: The first addend.
                b: The second addend.
            """
            return int(a) + b

    with pytest.raises(ValueError, match="parameter 'a' has no type hint"):
        tool_schemas(Unhinted)


async def test_a_tool_class_answers_each_call_and_ends_on_an_answer() -> None:
    env = ToolClassEnvironment(Calculator)
    task = EnvTask(prompt="What is 12 / 4 + 2?", reference="5")
    messages, tools = await env.reset(task)
    assert messages == [{"role": "user", "content": "What is 12 / 4 + 2?"}]
    assert [t["function"]["name"] for t in tools] == ["add", "divide"]

    call = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
    turn = "".join(
        [
            call % ("divide", '{"a": 12, "b": 4}'),
            call % ("add", '{"a": "3", "b": 2}'),  # lax: "3" is the integer 3
            call % ("add", '{"a": "three", "b": 2}'),
            call % ("divide", '{"a": 1, "b": 0}'),
            call % ("subtract", "{}"),
            "<tool_call>{oops}</tool_call>",
        ]
    )
    observation, reward, done = await env.step(turn)
    assert (reward, done) == (None, False)
    assert [m["role"] for m in observation] == ["tool"] * 6
    assert [m.get("name") for m in observation] == ["divide", "add", "add", "divide", "subtract", "error"]
    contents = [m["content"] for m in observation]
    assert contents[:2] == ["3.0", "5"]
    assert contents[2].startswith("Error: invalid arguments for add: 1 validation error")
    assert "Input should be a valid integer" in contents[2]
    assert contents[3] == "Error: ZeroDivisionError: float division by zero"
    assert contents[4] == "Error: no tool named 'subtract'; the tools are add, divide"
    assert contents[5].startswith("Error: a tool call is not valid JSON")
    assert env.instance.num_calls == 3  # the invalid and unknown calls never reached a method

    assert await env.step("The answer is 5.") == ([], 1.0, True)


async def test_a_tool_class_without_a_reward_leaves_it_to_the_verifier() -> None:
    class Echo:
        def echo(self, text: str) -> str:
            """Say it back.

            Args:
                text: What to say.
            """
            return text

    env = ToolClassEnvironment(Echo)
    await env.reset(EnvTask(prompt="Say hi"))
    assert await env.step('<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>') == (
        [{"role": "tool", "name": "echo", "content": "hi"}],
        None,
        False,
    )
    assert await env.step("hi") == ([], None, True)


def test_the_library_is_torch_free() -> None:
    import subprocess

    code = (
        "import sys, asymptote.envs, asymptote.envs.tools as t\n"
        "from tests.envs.tool_classes import Calculator\n"
        "t.tool_schemas(Calculator)\n"
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
