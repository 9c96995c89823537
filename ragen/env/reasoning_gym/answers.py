"""Which answers a reasoning-gym scorer that evaluates text may see: an allow-list, checked before scoring.

Nine datasets score an answer by evaluating it: ``eval`` (a Python list in place of the expected
text) or sympy's ``parse_expr`` (an expression). ``refusal(dataset, answer, item)`` says why an
answer must not reach such a scorer, or None when it may: either the scorer will not evaluate it
(it is the expected text) or it parses (``ast``, never compiled or run) as an expression of

- numbers, lists and tuples (and, for a list of letters, plain strings): for ``eval``;
- numbers, names that do not start with ``_``, arithmetic, unary and comparison operators, and
  calls of the math functions in ``FUNCTIONS``: for ``parse_expr``.

Nothing else (attributes, subscripts, keywords, lambdas, comprehensions, f-strings, strings given
to sympy) gets through, so no answer that passes can run code of its own; one that only computes
for long is the scorer process's wall bound's business (``scoring.py``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["EVALUATING", "FUNCTIONS", "MAX_CHARS", "refusal"]

MAX_CHARS = 100_000  # longer text is not parsed (the parse's time and memory grow with it)

# sympy's functions an answer may call (parse_expr evaluates the answer with sympy's names)
FUNCTIONS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "asec", "acsc", "atan2",
    "sinh", "cosh", "tanh", "coth", "sech", "csch", "asinh", "acosh", "atanh", "acoth", "asech", "acsch",
    "exp", "log", "ln", "sqrt", "cbrt", "root", "Abs", "abs", "sign", "floor", "ceiling", "factorial",
    "binomial", "gamma", "erf", "erfc", "erfi", "Ei", "Si", "Ci", "li", "LambertW", "Heaviside",
    "re", "im", "conjugate", "Max", "Min", "max", "min", "Rational", "Integer", "Pow", "Mul", "Add",
    "Integral",  # the integration datasets' answers hold Integral(f, x) where sympy found no closed form
})

_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_UNARY = (ast.UAdd, ast.USub)
_COMPARE = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


@dataclass(frozen=True)
class _Grammar:
    """What one kind of evaluator may be given."""

    containers: bool  # list and tuple literals
    strings: bool  # str literals (eval only: sympy would parse them)
    symbolic: bool  # names, binary and comparison operators, calls of FUNCTIONS


_LITERAL = _Grammar(containers=True, strings=False, symbolic=False)
_LETTERS = _Grammar(containers=True, strings=True, symbolic=False)
_SYMPY = _Grammar(containers=False, strings=False, symbolic=True)

# dataset -> (what its scorer evaluates, when it does not evaluate the answer at all)
EVALUATING: dict[str, tuple[_Grammar, Callable[[str, dict[str, Any]], bool]]] = {
    "binary_matrix": (_LITERAL, lambda a, item: a == item["answer"]),
    "n_queens": (_LETTERS, lambda a, item: a in item["metadata"]["valid_answers"]),
    "spiral_matrix": (_LITERAL, lambda a, item: not a or a.strip() == item["answer"].strip()),
    "string_insertion": (_LETTERS, lambda a, item: a == item["answer"]),
    "countdown": (_SYMPY, lambda a, item: not a.strip()),
    "puzzle24": (_SYMPY, lambda a, item: False),
    "polynomial_multiplication": (_SYMPY, lambda a, item: False),
    "simple_integration": (_SYMPY, lambda a, item: False),
    "intermediate_integration": (_SYMPY, lambda a, item: False),
}


def refusal(dataset: str, answer: str, item: dict[str, Any]) -> str | None:
    """Why ``answer`` must not be scored by ``dataset``'s scorer (it would be evaluated and is not an
    allowed expression), or None when it may."""
    if dataset not in EVALUATING:
        return None
    grammar, unevaluated = EVALUATING[dataset]
    if unevaluated(answer, item):
        return None
    if len(answer) > MAX_CHARS:
        return f"not evaluated: longer than {MAX_CHARS} characters"
    text = answer.strip() if dataset == "puzzle24" else answer  # puzzle24's scorer strips it first
    if grammar.symbolic and "#" in text:  # a comment: sympy re-joins the tokens it read, so none at all
        return "not evaluated: a comment"
    try:
        tree = ast.parse(text.lstrip(" \t"), mode="eval")  # as eval and parse_expr read it; never compiled
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        return f"not evaluated: not an expression ({type(exc).__name__})"
    for node in ast.walk(tree):
        why = _refused(node, grammar)
        if why is not None:
            return f"not evaluated: {why}"
    return None


def _refused(node: ast.AST, grammar: _Grammar) -> str | None:
    """Why ``node`` is not allowed by ``grammar``, or None."""
    if isinstance(node, (ast.Expression, ast.Load, ast.operator, ast.unaryop, ast.cmpop)):
        return None  # an operator is checked as part of its expression
    if isinstance(node, ast.Constant):
        kinds = (int, float, str) if grammar.strings else (int, float)
        if type(node.value) in kinds:
            return None
        return f"a {type(node.value).__name__} literal"
    if isinstance(node, ast.UnaryOp):
        return None if isinstance(node.op, _UNARY) else f"the operator {type(node.op).__name__}"
    if isinstance(node, (ast.List, ast.Tuple)) and grammar.containers:
        return None
    if grammar.symbolic:
        if isinstance(node, ast.BinOp):
            return None if isinstance(node.op, _ARITHMETIC) else f"the operator {type(node.op).__name__}"
        if isinstance(node, ast.Compare):
            bad = [type(op).__name__ for op in node.ops if not isinstance(op, _COMPARE)]
            return f"the operator {bad[0]}" if bad else None
        if isinstance(node, ast.Name):
            return f"the name {node.id!r}" if node.id.startswith("_") else None
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
                return "a call of something other than a math function"
            if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
                return "a call with keywords or unpacking"
            return None
    return f"{type(node).__name__} is not allowed here"
