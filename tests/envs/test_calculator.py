"""The calculator tool: arithmetic values exactly, everything else refused with the reason, and the tool as
a model sees and calls it through the pool (a turn with a Hermes call, the tool message back, the answer)."""

from __future__ import annotations

import pytest

from asymptote.envs import EnvironmentPool, EnvironmentSettings, EnvTask, tool_schemas
from asymptote.envs.calculator import Calculator, evaluate, shown


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("8 + (8 * 2 - 5)", "19"),
        ("(13 + 7) / 5", "4"),
        ("-3 * -4", "12"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.3333333333"),
        ("  2*3 ", "6"),
        ("2.5 * 4", "10"),
    ],
)
def test_values(expression: str, value: str) -> None:
    assert Calculator().calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "said"),
    [
        ("2 ** 10", "not '2 ** 10'"),
        ("__import__('os')", "not \"__import__('os')\""),
        ("x + 1", "not 'x'"),
        ("(1).real", "not '1 .real'"),
        ("'a' * 3", "not \"'a'\""),
        ("True + 1", "not 'True'"),
        ("5 / (2 - 2)", "division by zero"),
        ("1e16 + 1", "a value beyond 1e+15"),
        ("99999999 * 99999999", "a value beyond 1e+15"),
        ("1 +", "not an arithmetic expression: '1 +'"),
        ("1" * 201, "longer than 200 characters"),
    ],
)
def test_anything_else_is_refused_with_the_reason(expression: str, said: str) -> None:
    with pytest.raises(ValueError) as caught:
        evaluate(expression)
    assert said in str(caught.value)


def test_shown_values() -> None:
    assert [shown(v) for v in (3.0, -2.0, 0.1 + 0.2, 1e15)] == ["3", "-2", "0.3", "1000000000000000"]


def test_the_tool_s_schema() -> None:
    assert tool_schemas(Calculator) == [
        {
            "type": "function",
            "function": {
                "name": "calculate",
                "description": "Compute the value of an arithmetic expression.",
                "parameters": {
                    "additionalProperties": False,
                    "type": "object",
                    "properties": {
                        "expression": {
                            "type": "string",
                            "description": 'Numbers joined by + - * / with parentheses, e.g. "8 + (8 * 2 - 5)".',
                        }
                    },
                    "required": ["expression"],
                },
            },
        }
    ]


async def test_an_episode_calls_the_tool_then_answers() -> None:
    pool = EnvironmentPool(EnvironmentSettings(entry="asymptote.envs.calculator:Calculator", kind="tools"))
    await pool.start()
    try:
        async with pool.episode() as env:
            messages, _ = await env.reset(EnvTask(prompt="Ivo has 8 stamps ...", reference="19"))
            assert messages == [{"role": "user", "content": "Ivo has 8 stamps ..."}]
            call = '<tool_call>{"name": "calculate", "arguments": {"expression": "8 + (8 * 2 - 5)"}}</tool_call>'
            called = await env.step(call)
            assert (called.observation, called.done) == (
                [{"role": "tool", "name": "calculate", "content": "19"}],
                False,
            )
            bad = '<tool_call>{"name": "calculate", "arguments": {"expression": "2 ** 99"}}</tool_call>'
            refused = await env.step(bad)
            assert refused.observation[0]["content"].startswith("Error: ValueError: only numbers")
            answered = await env.step("So \\boxed{19}.")
            assert (answered.observation, answered.reward, answered.done) == ([], None, True)  # the verifier scores it
    finally:
        pool.close()
