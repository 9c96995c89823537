"""The code env's shipped problems: a few hundred, generated from a seed, each with tests.

A ``Problem`` is a statement, a kind (``call``: write a function, tested by
calls with expected return values; ``stdio``: write a program, tested by
stdin and the stdout it must print) and its tests. ``problem(seed)`` is a pure
function of the seed: family ``seed % len(FAMILIES)``, its parameters and test
inputs drawn from ``seed``. ``count()`` problems are distinct (seeds past it
repeat them). Expected outputs come from each family's reference solution, run
here in-process (our own code); ``solutions(problem)`` gives the reference and
wrong ones (off by one, a crash, a loop that never ends), the pool the
``code_exec`` benchmark's scripted policy answers from.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["FAMILIES", "Problem", "Test", "count", "problem", "solutions"]


@dataclass(frozen=True)
class Test:
    """``call``: ``input`` is the JSON list of arguments, ``expected`` the JSON return value;
    ``stdio``: ``input`` is the stdin text, ``expected`` the stdout text."""

    input: Any
    expected: Any


@dataclass(frozen=True)
class Problem:
    id: str
    kind: str  # "call" or "stdio"
    statement: str
    tests: tuple[Test, ...]
    func_name: str | None = None  # call: the function the tests call
    starter_code: str = ""


@dataclass(frozen=True)
class _Family:
    name: str
    kind: str
    variants: int  # distinct parameter sets
    statement: Callable[[int], str]
    reference: Callable[[int], str]  # the source of a correct solution
    wrong: Callable[[int], list[str]]  # sources of wrong ones
    inputs: Callable[[int, random.Random], list[Any]]  # test inputs (argument lists, or stdin texts)
    func_name: str | None = None


_CHARSETS = ("aeiou", "aeiouy", "xyz", "aeo", "st", "lmnr")


def _ints(rng: random.Random, n: int, lo: int = -50, hi: int = 50) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _words(rng: random.Random, n: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(1, 7))) for _ in range(n))


FAMILIES: tuple[_Family, ...] = (
    _Family("top_k_sum", "call", 20,
            lambda k: f"Write a function `top_sum(nums)` that returns the sum of the {k + 1} largest numbers of the "
                      f"list `nums` (it has at least {k + 1} numbers).",
            lambda k: f"def top_sum(nums):\n    return sum(sorted(nums, reverse=True)[:{k + 1}])\n",
            lambda k: [f"def top_sum(nums):\n    return sum(sorted(nums, reverse=True)[:{k}])\n",
                       f"def top_sum(nums):\n    return sum(sorted(nums)[:{k + 1}])\n"],
            lambda k, rng: [[list(range(1, k + 4))]] + [[_ints(rng, rng.randint(k + 1, k + 8))] for _ in range(4)],
            "top_sum"),
    _Family("count_chars", "call", 6,
            lambda v: f"Write a function `count(s)` that returns how many characters of the string `s` are among "
                      f"{_CHARSETS[v]!r}.",
            lambda v: f"def count(s):\n    return sum(c in {_CHARSETS[v]!r} for c in s)\n",
            lambda v: [f"def count(s):\n    return sum(c in {_CHARSETS[v][:-1]!r} for c in s)\n",
                       "def count(s):\n    return len(s)\n"],
            lambda v, rng: [[_CHARSETS[v] + " qq"]] + [[_words(rng, rng.randint(1, 6))] for _ in range(4)], "count"),
    _Family("fib_mod", "call", 200,
            lambda m: f"Write a function `fib(n)` that returns the n-th Fibonacci number modulo {m + 7} "
                      "(fib(0) = 0, fib(1) = 1).",
            lambda m: f"def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, (a + b) % {m + 7}\n"
                      "    return a\n",
            lambda m: [f"def fib(n):\n    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, (a + b) % {m + 7}\n"
                       "    return a\n",
                       "def fib(n):\n    return fib(n - 1) + fib(n - 2) if n > 1 else n\n"],
            lambda m, rng: [[20]] + [[rng.randint(0, 30)] for _ in range(3)] + [[rng.randint(5000, 20000)]], "fib"),
    _Family("palindrome", "call", 2,
            lambda v: "Write a function `is_pal(s)` that returns True when `s` reads the same backwards"
                      + (", ignoring case and every character that is not a letter or a digit" if v else "") + ".",
            lambda v: ("def is_pal(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n" if v
                       else "def is_pal(s):\n    return s == s[::-1]\n"),
            lambda v: ["def is_pal(s):\n    return s == s[::-1]\n" if v else
                       "def is_pal(s):\n    return s.lower() == s.lower()[::-1]\n",
                       "def is_pal(s):\n    return True\n"],
            lambda v, rng: [["Abba"], ["abc"]] + [[rng.choice(["abba", "No lemon, no melon", "a", "Ab,a", "xyzzyx",
                                                              "ab"])] for _ in range(4)], "is_pal"),
    _Family("gcd_list", "call", 1,
            lambda v: "Write a function `gcd_all(nums)` that returns the greatest common divisor of the positive "
                      "integers in `nums`.",
            lambda v: "import math\n\ndef gcd_all(nums):\n    g = 0\n    for n in nums:\n        g = math.gcd(g, n)\n"
                      "    return g\n",
            lambda v: ["def gcd_all(nums):\n    return min(nums)\n", "def gcd_all(nums):\n    return 1\n"],
            lambda v, rng: [[[12, 18]], [[4, 8]]] + [[[rng.choice([2, 3, 5, 6, 12]) * rng.randint(1, 40)
                                                       for _ in range(rng.randint(2, 5))]] for _ in range(3)],
            "gcd_all"),
    _Family("run_length", "call", 1,
            lambda v: "Write a function `rle(s)` that returns the run-length encoding of `s`: each run of one "
                      "character as the character followed by the run's length, e.g. rle('aaab') == 'a3b1'.",
            lambda v: "def rle(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n"
                      "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
                      "        out.append(s[i] + str(j - i))\n        i = j\n    return ''.join(out)\n",
            lambda v: ["def rle(s):\n    return ''.join(c + '1' for c in s)\n",
                       "def rle(s):\n    i = 0\n    while i < len(s):\n        pass\n    return ''\n"],
            lambda v, rng: [["aaab"]] + [["".join(rng.choice("ab") * rng.randint(1, 4) for _ in range(rng.randint(0, 5)))]
                                         for _ in range(4)], "rle"),
    _Family("brackets", "call", 2,
            lambda v: "Write a function `balanced(s)` that returns True when the brackets " + ("()[]{}" if v else "()")
                      + " in `s` are balanced.",
            lambda v: f"def balanced(s):\n    pairs = {{')': '(', ']': '[', '}}': '{{'}}\n    stack = []\n"
                      f"    for c in s:\n        if c in {'([{' if v else '('!r}:\n            stack.append(c)\n"
                      f"        elif c in {')]}' if v else ')'!r}:\n"
                      "            if not stack or stack.pop() != pairs[c]:\n                return False\n"
                      "    return not stack\n",
            lambda v: ["def balanced(s):\n    return s.count('(') == s.count(')')\n",
                       "def balanced(s):\n    return s[0] == '('\n"],
            lambda v, rng: [[")("], [""], ["(()"]] + [["".join(rng.choice("()[]{}" if v else "()")
                                                           for _ in range(rng.randint(0, 8)))] for _ in range(3)],
            "balanced"),
    _Family("sum_lines", "stdio", 3,
            lambda v: "Write a program that reads an integer n, then n lines of integers separated by spaces, and "
                      + ["prints the sum of each line", "prints the largest number of each line",
                         "prints the number of even numbers on each line"][v] + ", one result a line.",
            lambda v: "n = int(input())\nfor _ in range(n):\n    nums = list(map(int, input().split()))\n"
                      + ["    print(sum(nums))\n", "    print(max(nums))\n",
                         "    print(sum(1 for x in nums if x % 2 == 0))\n"][v],
            lambda v: ["n = int(input())\nfor _ in range(n - 1):\n    print(sum(map(int, input().split())))\n",
                       "n = int(input())\nprint(n)\n"],
            lambda v, rng: [(lambda rows: f"{len(rows)}\n" + "".join(" ".join(map(str, r)) + "\n" for r in rows))(
                [_ints(rng, rng.randint(1, 5)) for _ in range(rng.randint(1, 4))]) for _ in range(4)]),
    _Family("reverse_words", "stdio", 2,
            lambda v: "Write a program that reads one line and prints its words in reverse order"
                      + (", each word upper-cased" if v else "") + ", separated by single spaces.",
            lambda v: "print(' '.join(w" + (".upper()" if v else "") + " for w in reversed(input().split())))\n",
            lambda v: ["print(input()[::-1])\n", "print(' '.join(input().split()))\n"],
            lambda v, rng: ["hello big world\n"] + [_words(rng, rng.randint(1, 6)) + "\n" for _ in range(3)]),
    _Family("primes_below", "stdio", 1,
            lambda v: "Write a program that reads an integer n and prints how many primes are smaller than n.",
            lambda v: "n = int(input())\nsieve = [True] * max(n, 2)\nsieve[0] = sieve[1] = False\n"
                      "for i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n"
                      "        sieve[i * i::i] = [False] * len(sieve[i * i::i])\nprint(sum(sieve[:n]))\n",
            lambda v: ["n = int(input())\nprint(sum(all(k % d for d in range(2, k)) for k in range(2, n + 1)))\n",
                       "import sys\nsys.exit(1)\n"],
            lambda v, rng: [f"{rng.randint(0, 200)}\n" for _ in range(3)] + [f"{rng.randint(100000, 300000)}\n"]),
)


def count() -> int:
    """How many distinct problems there are."""
    return sum(f.variants for f in FAMILIES)


def _family_and_variant(seed: int) -> tuple[_Family, int]:
    family = FAMILIES[seed % len(FAMILIES)]
    return family, (seed // len(FAMILIES)) % family.variants


def _run_reference(source: str, kind: str, func_name: str | None, value: Any) -> Any:
    """The reference's answer for one input (our own code, run in this process)."""
    import contextlib
    import io

    scope: dict[str, Any] = {"__name__": "__main__" if kind == "stdio" else "solution"}
    if kind == "call":
        exec(compile(source, "<reference>", "exec"), scope)  # noqa: S102 - our reference solution
        return json.loads(json.dumps(scope[func_name](*json.loads(json.dumps(value)))))
    out = io.StringIO()
    lines = iter(value.splitlines())
    scope["input"] = lambda *_: next(lines)
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<reference>", "exec"), scope)  # noqa: S102 - our reference solution
    return out.getvalue()


def problem(seed: int) -> Problem:
    """The problem of ``seed``: a pure function of it."""
    family, variant = _family_and_variant(seed)
    rng = random.Random(f"ragen-code-{seed}")
    reference = family.reference(variant)
    tests = tuple(Test(x, _run_reference(reference, family.kind, family.func_name, x))
                  for x in family.inputs(variant, rng))
    return Problem(id=f"{family.name}-{variant}-{seed}", kind=family.kind, statement=family.statement(variant),
                   tests=tests, func_name=family.func_name)


def solutions(seed: int) -> tuple[str, list[str]]:
    """(a correct solution, wrong ones) of the problem of ``seed``."""
    family, variant = _family_and_variant(seed)
    return family.reference(variant), family.wrong(variant)
