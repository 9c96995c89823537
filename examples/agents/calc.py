"""The task every agent example shares: arithmetic with a calculator tool, and its reward.

- ``calculate(expression)``: a ``+ - * /`` expression of numbers and parentheses, evaluated by
  walking its ``ast`` (no ``eval`` of what a model wrote: any other node is refused), as the
  tool's text result, never an exception: an error is text the model reads;
- ``score(task, final, tool_calls)``: the episode's result, reward 1.0 when the last number of
  the final answer is the task's answer, else 0.0, with what the agent did as info;
- ``TOOL``: the calculator's OpenAI function schema; ``INSTRUCTIONS``: the system prompt;
- ``python -m examples.agents.calc``: writes the tasks file ``calc.jsonl`` (``make_tasks(64)``, seed 0).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from pathlib import Path
from typing import Any

TASKS = Path(__file__).with_name("calc.jsonl")
MAX_TURNS = 3  # model calls an agent makes at most: a model that never answers ends there
MAX_EXPRESSION_CHARS = 200
INSTRUCTIONS = ("You are a careful assistant. Compute arithmetic with the calculator tool, "
                "then give the final answer as a number.")
TOOL = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "The expression, e.g. 37 * 41 + 5"}},
        "required": ["expression"]}}}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_value(node.operand))
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {what}")


def evaluate(expression: str) -> float:
    """The value of ``expression``; ValueError (or ZeroDivisionError) when it is not one."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression must be text of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def shown(value: float) -> str:
    """A value as the calculator writes it: an integer without ``.0``."""
    if isinstance(value, int):
        return str(value)
    return str(int(value)) if value.is_integer() else f"{value:.6g}"


def calculate(expression: str) -> str:
    """The calculator tool: ``"<expression> = <value>"``, or ``"error: ..."`` for the model to read."""
    try:
        value = shown(evaluate(expression))
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError) as exc:
        return f"error: {exc}"
    return f"{expression.strip()} = {value}"


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (thousands separators dropped), or None."""
    found = _NUMBER.findall(_THOUSANDS.sub("", text or ""))
    return found[-1] if found else None


def score(task: dict[str, Any], final: str, tool_calls: int, **info: Any) -> dict[str, Any]:
    """An episode's result: reward 1.0 when the final answer's last number is ``task["answer"]``."""
    given = last_number(final)
    right = given is not None and abs(float(given) - task["answer"]) < 1e-6
    return {"reward": 1.0 if right else 0.0, "success": right, "answer": task["answer"], "given": given,
            "final": (final or "")[-200:], "tool_calls": tool_calls, **info}


def make_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct tasks ``{"question", "expression", "answer"}`` of mixed difficulty, so that a
    small model gets some right and a group's rewards differ: of every four, one adds and one
    subtracts numbers up to 20 (the answer not negative), one applies + - or * to numbers below
    100, one chains two operations (a division only where it is exact)."""
    rng = random.Random(seed)
    tasks: list[dict[str, Any]] = []
    while len(tasks) < n:
        level = len(tasks) % 4
        if level < 2:
            a, b = sorted((rng.randint(1, 20), rng.randint(1, 20)), reverse=True)
            expression = f"{a} {'+-'[level]} {b}"
        elif level == 2:
            expression = f"{rng.randint(2, 99)} {rng.choice('+-*')} {rng.randint(2, 99)}"
        else:
            b, c, op1, op2 = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*/"), rng.choice("+-*")
            a = b * rng.randint(2, 20) if op1 == "/" else rng.randint(2, 99)
            expression = f"{a} {op1} {b} {op2} {c}"
        if all(t["expression"] != expression for t in tasks):
            tasks.append({"question": f"What is {expression}?", "expression": expression,
                          "answer": int(evaluate(expression))})
    return tasks


if __name__ == "__main__":
    TASKS.write_text("".join(json.dumps(t) + "\n" for t in make_tasks(64)))
    print(f"wrote {TASKS}")
