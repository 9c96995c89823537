"""Safe checking of Countdown answers: a tokenizer and a recursive-descent parser.

Concepts:

- **Equation**: arithmetic over non-negative integer literals with ``+ - * /``
  and parentheses, e.g. ``(100 - 4) / 8 + 3``. An optional ``= <anything
  numeric>`` tail is tolerated and ignored (models often write the result);
  the left side is what is checked.
- **Grammar**: ``expr := term (("+" | "-") term)*``,
  ``term := factor (("*" | "/") factor)*``, ``factor := NUMBER | "(" expr ")"``.
  No unary minus, no other characters: the answer must use the given numbers
  as they are.
- **Exact arithmetic**: ``fractions.Fraction``, so ``8 / 3 * 3`` is exactly 8
  and nothing depends on floating-point rounding.

The answer is never passed to ``eval``. Input longer than
``MAX_EQUATION_CHARS``, nesting deeper than ``MAX_NESTING`` or literals longer
than ``MAX_LITERAL_DIGITS`` are rejected before any work grows with them.
``parse_equation`` never raises: anything wrong comes back as a result with
``well_formed=False`` and an ``error``. Division by zero is well formed (the
syntax is right) but has no value.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from ...errors import RagenError

__all__ = [
    "EquationResult",
    "MAX_EQUATION_CHARS",
    "MAX_LITERAL_DIGITS",
    "MAX_NESTING",
    "parse_equation",
    "uses_numbers_exactly",
]

MAX_EQUATION_CHARS = 256
MAX_NESTING = 32
MAX_LITERAL_DIGITS = 12

_DIGITS = frozenset("0123456789")
_OPERATORS = frozenset("+-*/()")
_SPACES = frozenset(" \t\n\r")


@dataclass(frozen=True)
class EquationResult:
    """What ``parse_equation`` found.

    ``value`` is None when the text is not well formed or divides by zero;
    ``numbers`` lists the integer literals in the order written.
    """

    well_formed: bool
    value: Fraction | None = None
    numbers: tuple[int, ...] = ()
    error: str = ""


class _ParseError(RagenError):
    pass


class _DivisionByZero(RagenError):
    pass


def _tokenize(text: str) -> list[str | int]:
    tokens: list[str | int] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in _SPACES:
            i += 1
        elif ch in _DIGITS:
            j = i
            while j < n and text[j] in _DIGITS:
                j += 1
            if j - i > MAX_LITERAL_DIGITS:
                raise _ParseError(f"number longer than {MAX_LITERAL_DIGITS} digits")
            tokens.append(int(text[i:j]))
            i = j
        elif ch in _OPERATORS:
            tokens.append(ch)
            i += 1
        else:
            raise _ParseError(f"unexpected character {ch!r}")
    return tokens


def _add(op: str, a: Fraction, b: Fraction) -> Fraction:
    return a + b if op == "+" else a - b


def _multiply(op: str, a: Fraction, b: Fraction) -> Fraction:
    if op == "*":
        return a * b
    if b == 0:
        raise _DivisionByZero()
    return a / b


class _Parser:
    def __init__(self, tokens: list[str | int], evaluate: bool = True) -> None:
        self.tokens = tokens
        self.evaluate = evaluate  # False: check the syntax only, no arithmetic
        self.pos = 0
        self.depth = 0
        self.numbers: list[int] = []

    def peek(self) -> str | int | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expr(self) -> Fraction:
        return self._chain(("+", "-"), self.term, _add)

    def term(self) -> Fraction:
        return self._chain(("*", "/"), self.factor, _multiply)

    def _chain(self, ops: tuple[str, ...], operand: Callable[[], Fraction],
               combine: Callable[[str, Fraction, Fraction], Fraction]) -> Fraction:
        """``operand (op operand)*`` for ``op`` in ``ops``, combined left to right
        (not at all when checking the syntax only)."""
        value = operand()
        while self.peek() in ops:
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = operand()
            if self.evaluate:
                value = combine(op, value, rhs)
        return value

    def factor(self) -> Fraction:
        token = self.peek()
        if isinstance(token, int):
            self.pos += 1
            self.numbers.append(token)
            return Fraction(token)
        if token == "(":
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise _ParseError(f"parentheses nested deeper than {MAX_NESTING}")
            self.pos += 1
            value = self.expr()
            if self.peek() != ")":
                raise _ParseError("missing ')'")
            self.pos += 1
            self.depth -= 1
            return value
        if token is None:
            raise _ParseError("unexpected end of equation")
        raise _ParseError(f"unexpected {token!r}")


def _syntax_only(tokens: list[str | int]) -> tuple[bool, tuple[int, ...], str]:
    """Parse without arithmetic: is the text well formed? (after a division by zero,
    so that a syntax error later in the text still makes it malformed)."""
    parser = _Parser(tokens, evaluate=False)
    try:
        parser.expr()
        if parser.pos != len(tokens):
            raise _ParseError(f"unexpected {tokens[parser.pos]!r}")
    except _ParseError as exc:
        return False, (), str(exc)
    return True, tuple(parser.numbers), ""


def parse_equation(text: Any) -> EquationResult:
    """Parse and evaluate ``text`` exactly; never raises, never evaluates code."""
    if not isinstance(text, str):
        return EquationResult(False, error=f"expected text, got {type(text).__name__}")
    if len(text) > MAX_EQUATION_CHARS:
        return EquationResult(False, error=f"longer than {MAX_EQUATION_CHARS} characters")
    lhs, sep, rhs = text.partition("=")
    if sep:
        rhs = rhs.strip()
        if "=" in rhs or (rhs and not _is_number(rhs)):
            return EquationResult(False, error="only '<expression> = <number>' may contain '='")
    try:
        tokens = _tokenize(lhs)
        if not tokens:
            return EquationResult(False, error="empty equation")
        parser = _Parser(tokens)
        value = parser.expr()
        if parser.pos != len(tokens):
            raise _ParseError(f"unexpected {tokens[parser.pos]!r}")
    except _ParseError as exc:
        return EquationResult(False, error=str(exc))
    except _DivisionByZero:
        ok, numbers, error = _syntax_only(tokens)
        return EquationResult(ok, None, numbers, error or "division by zero")
    except RecursionError:  # cannot happen below MAX_NESTING; belt and braces
        return EquationResult(False, error="equation nested too deeply")
    return EquationResult(True, value, tuple(parser.numbers))


def _is_number(text: str) -> bool:
    body = text[1:] if text[:1] == "-" else text
    whole, _, frac = body.partition(".")
    return bool(whole) and all(ch in _DIGITS for ch in whole) and all(ch in _DIGITS for ch in frac)


def uses_numbers_exactly(result: EquationResult, numbers: tuple[int, ...] | list[int]) -> bool:
    """Whether the equation uses each given number exactly once (as a multiset)."""
    return sorted(result.numbers) == sorted(int(n) for n in numbers)
