"""A calculator as a tool-using environment: the model writes an arithmetic expression, the tool gives its value.

``Calculator`` is a plain class of tools (``kind: tools``,
asymptote.envs.tools): one tool, ``calculate``, for word problems whose
answer the model reaches by calling it in one turn and giving the answer,
``\\boxed{}``, in the next (the dataset's verifier scores that turn). The
expression is parsed, never executed: numbers, ``+ - * /``, unary signs
and parentheses only, bounded in length and in the size of every value.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15
"""Largest absolute value of any number or intermediate result."""

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> float:
    """The value of ``expression``; ValueError naming what is not allowed or cannot be computed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.expr) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return _bounded(float(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise ValueError(f"only numbers, + - * /, signs and parentheses are allowed, not {ast.unparse(node)!r}")


def _bounded(value: float) -> float:
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a value beyond {MAX_MAGNITUDE:g}")
    return value


def shown(value: float) -> str:
    """A value as the tool answers it: an integer without a decimal point, else up to 10 significant digits."""
    if value == int(value):
        return str(int(value))
    return f"{value:.10g}"


class Calculator:
    """The calculator's tool; an episode's answer is scored by the task's verifier (no reward of its own)."""

    def calculate(self, expression: str) -> str:
        """Compute the value of an arithmetic expression.

        Args:
            expression: Numbers joined by + - * / with parentheses, e.g. "8 + (8 * 2 - 5)".
        """
        return shown(evaluate(expression))
