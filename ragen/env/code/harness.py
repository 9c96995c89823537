"""A submission tested: the answer's code and a problem's tests in one sandboxed run.

``judge(code, problem, limits)`` builds one script that runs every test in
turn (a ``call`` test calls the function with the test's arguments and
compares the return value, as JSON, with the expected one; a ``stdio`` test
runs the program with the test's stdin and compares its stdout, line by line,
trailing spaces and blank lines ignored), runs it in the sandbox once, and
reads the results from a line marked with a token the code cannot know.
A program's stdout is kept up to the output limit; a test that prints more
ends with "output truncated", as a run that prints more does.
A test the run did not reach (a time limit, an ``os._exit``) has failed.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from .problems import Problem
from ..sandbox import Limits, RunResult, RunStatus, run_python

__all__ = ["Verdict", "extract_code", "judge"]

_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)
_SHOWN = 300  # characters of an input, output or error shown in a verdict

_HARNESS = r'''
import contextlib, io, json, sys
_TOKEN, _KIND, _FUNC, _TESTS, _CODE = {token!r}, {kind!r}, {func!r}, json.loads({tests!r}), {code!r}
_LIMIT = {output_bytes!r}
_out = sys.stdout
_results = []

class _OutputLimit(BaseException):
    pass

class _Capped(io.StringIO):
    def write(self, text):
        if self.tell() + len(text) > _LIMIT:
            raise _OutputLimit()
        return super().write(text)

def _report():
    _out.write("\n" + _TOKEN + json.dumps(_results) + "\n")
    _out.flush()

def _norm(text):
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines

try:
    _compiled = compile(_CODE, "solution.py", "exec")
except SyntaxError as exc:
    _results.append({{"error": "SyntaxError: " + str(exc)}})
    _report()
    sys.exit(0)
if _KIND == "call":
    _scope = {{"__name__": "solution"}}
    try:
        exec(_compiled, _scope)
        _fn = _scope[_FUNC] if _FUNC in _scope else getattr(_scope["Solution"](), _FUNC)
    except BaseException as exc:
        _results.append({{"error": type(exc).__name__ + ": " + str(exc)}})
        _report()
        sys.exit(0)
for _test in _TESTS:
    _buf = _Capped()
    try:
        if _KIND == "call":
            _got = json.loads(json.dumps(_fn(*_test[0])))
            _results.append({{"ok": _got == _test[1], "got": _got}})
        else:
            sys.stdin = io.StringIO(_test[0])
            with contextlib.redirect_stdout(_buf):
                try:
                    exec(_compiled, {{"__name__": "__main__"}})
                except SystemExit as exc:
                    if exc.code not in (None, 0):
                        raise
            _results.append({{"ok": _norm(_buf.getvalue()) == _norm(_test[1]), "got": _buf.getvalue()}})
    except _OutputLimit:
        _results.append({{"limit": "output"}})
    except BaseException as exc:
        _results.append({{"error": type(exc).__name__ + ": " + str(exc)[:300]}})
_report()
'''


@dataclass(frozen=True)
class Verdict:
    """How a submission did: tests passed of total, the run's status, and the first failure in words."""

    passed: int
    total: int
    status: RunStatus
    feedback: str
    cpu_s: float

    @property
    def correct(self) -> bool:
        return self.passed == self.total and self.total > 0


def extract_code(answer: str) -> str:
    """The code of an answer: the first fenced block (```python ... ```), else the answer itself."""
    match = _FENCE.search(answer)
    return (match.group(1) if match else answer).strip("\n")


def _short(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def judge(code: str, problem: Problem, limits: Limits) -> Verdict:
    """``code`` run against ``problem``'s tests in one sandboxed run."""
    token = "@@ragen-results-" + secrets.token_hex(8) + "@@"
    tests = json.dumps([[t.input, t.expected] for t in problem.tests])
    script = _HARNESS.format(token=token, kind=problem.kind, func=problem.func_name, tests=tests, code=code,
                             output_bytes=limits.output_bytes)
    run = run_python(script, "", limits)
    results = []
    _, sep, tail = run.stdout.rpartition(token)
    if sep:
        try:
            results = json.loads(tail.splitlines()[0])
        except (ValueError, IndexError):  # cut by the output limit
            results = []
    passed = sum(1 for r in results if r.get("ok"))
    return Verdict(passed, len(problem.tests), run.status, _feedback(problem, results, passed, run), run.cpu_s)


def _feedback(problem: Problem, results: list[dict], passed: int, run: RunResult) -> str:
    total = len(problem.tests)
    if passed == total:
        return f"All {total} tests passed."
    words = f"Passed {passed}/{total} tests."
    if len(results) == 1 and "error" in results[0] and len(problem.tests) != 1:
        return f"{words} Your code did not run: {_short(results[0]['error'])}"
    for i, test in enumerate(problem.tests):
        shown = (f"{problem.func_name}(" + ", ".join(json.dumps(a) for a in test.input) + ")"
                 if problem.kind == "call" else f"input {_short(test.input)!r}")
        if i >= len(results):
            why = {RunStatus.TIME_LIMIT: "time limit exceeded", RunStatus.MEMORY_LIMIT: "memory limit exceeded",
                   RunStatus.OUTPUT_LIMIT: "output truncated: it printed too much"}.get(run.status)
            if why is None:
                last = run.stderr.strip().splitlines()[-1:] or ["the program ended before this test"]
                why = _short(last[0])
            return f"{words} First failing test, {shown}: {why}."
        result = results[i]
        if result.get("ok"):
            continue
        if "limit" in result:
            return f"{words} First failing test, {shown}: output truncated: it printed too much."
        if "error" in result:
            return f"{words} First failing test, {shown}: raised {_short(result['error'])}."
        expected, got = test.expected, result.get("got")
        if problem.kind == "call":
            return f"{words} First failing test: {shown} returned {_short(got)}, expected {_short(expected)}."
        return f"{words} First failing test, {shown}: printed {_short(got)!r}, expected {_short(expected)!r}."
    return words
