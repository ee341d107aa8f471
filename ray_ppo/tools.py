"""Tools a policy can call in a multi-turn episode, and reading its calls.

    calculate("347 * 29")               # "10063": arithmetic only, evaluated on the syntax tree (no eval)
    parse_tool_calls(response)          # [{"name": "calculator", "arguments": {"expression": "347 * 29"}}]

A call is written as chat templates with tool support write one (Hermes / Qwen style):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. ``CALCULATOR`` is the calculator's
JSON schema, for ``Environment.tools``.
"""

from __future__ import annotations

import ast
import json
import operator
import re

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolError(ValueError):
    """An expression the calculator does not evaluate; the message says why."""


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text ("12", "2.5"), or "error: ..." saying why
    there is none. Only numbers, the operators of ``_BINARY`` and ``_UNARY`` and parentheses are
    read; names, calls and attributes are refused, exponents above ``MAX_EXPONENT`` and results
    above ``MAX_MAGNITUDE`` too, so no expression can run long or grow large."""
    try:
        if len(expression) > MAX_EXPRESSION_CHARS:
            raise ToolError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise ToolError(f"cannot read {expression!r} as arithmetic") from None
        value = _evaluate(tree.body)
    except (ToolError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"the exponent {right} is above {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ToolError("the result is out of range")
        return value
    raise ToolError(f"{type(node).__name__} is not arithmetic (numbers, + - * / // % ** and parentheses only)")


def without_tool_calls(text: str) -> str:
    """``text`` with its ``<tool_call>...</tool_call>`` blocks taken out, stripped."""
    return _CALL.sub("", text).strip()


def parse_tool_calls(text: str) -> list[dict]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``, in order, as
    ``{"name", "arguments"}``; a call that is not such JSON comes back as ``{"name": None, "error": ...}``."""
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append({"name": None, "error": f"the tool call is not JSON ({e.msg})"})
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments", {}), dict):
            calls.append({"name": None, "error": 'a tool call is {"name": "...", "arguments": {...}}'})
            continue
        calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    return calls
