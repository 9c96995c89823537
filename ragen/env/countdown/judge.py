"""RAGEN's judgement of a Countdown answer, without ``eval``.

RAGEN scores an answer in two checks: the integers written in it (every run of
digits) must be the puzzle's numbers, as a multiset; then the text, evaluated
as a Python expression with no names available, must come within 1e-5 of the
target. ``python_arithmetic`` gives that second check's value by walking the
expression's syntax tree: numeric literals, unary and binary arithmetic and
bitwise operators and comparisons, computed with Python's own operators (so
``7 / 2`` is 3.5 and ``7 // 2`` is 3, as ``eval`` gives). Anything else (a
name, a call, an attribute) has no value, as it has none under RAGEN's
``eval``. Powers and shifts whose result would exceed ``MAX_RESULT_BITS`` have
no value either (``eval`` would spend minutes on them).
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from ...errors import RagenError

__all__ = ["MAX_RESULT_BITS", "python_arithmetic", "ragen_numbers_match", "ragen_correct"]

MAX_RESULT_BITS = 1_000_000

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
    ast.RShift: operator.rshift, ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert, ast.Not: operator.not_}
_COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
            ast.Eq: operator.eq, ast.NotEq: operator.ne}


class _NoValue(RagenError):
    pass


def _too_big(op: type, a: Any, b: Any) -> bool:
    if not (isinstance(a, int) and isinstance(b, int)):
        return False
    if op is ast.Pow:
        return b > 0 and abs(a) > 1 and b * abs(a).bit_length() > MAX_RESULT_BITS
    if op is ast.LShift:
        return b > MAX_RESULT_BITS
    return False


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, complex)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _value(node.left), _value(node.right)
        if _too_big(type(node.op), a, b):
            raise _NoValue
        return _BINARY[type(node.op)](a, b)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        left = _value(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = _value(right_node)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    raise _NoValue


def python_arithmetic(text: str) -> Any:
    """The value ``eval(text, {"__builtins__": None}, {})`` gives for arithmetic text; None if it has none."""
    try:
        # eval strips leading spaces and tabs of a string; ast.parse would call them an indent
        return _value(ast.parse(text.lstrip(" \t"), mode="eval"))
    except (_NoValue, SyntaxError, ValueError, ArithmeticError, TypeError, RecursionError, MemoryError):
        return None


def ragen_numbers_match(text: Any, numbers: list[int] | tuple[int, ...]) -> bool:
    """RAGEN's format check: the runs of digits in ``text`` are ``numbers``, in any order."""
    if not isinstance(text, str):
        return False
    try:
        return sorted(int(n) for n in re.findall(r"\d+", text)) == sorted(numbers)
    except ValueError:
        return False


def ragen_correct(text: str, target: int) -> bool:
    """RAGEN's correctness check: the text's value is within 1e-5 of ``target``."""
    value = python_arithmetic(text)
    if value is None:
        return False
    try:
        return bool(abs(value - target) < 1e-5)
    except (TypeError, ArithmeticError):
        return False
