"""A submission tested: its code run on a problem's test inputs in one sandboxed run, and judged here.

``judge(code, problem, limits)`` gives the sandboxed child the code and each
test's input, never an expected output. The child prints one result line per
test (a ``call`` test's return value as JSON, a ``stdio`` test's stdout, or
the error), and this process compares them with the expected outputs (as JSON
data; stdout line by line, trailing spaces and blank lines ignored). So a
child can fail its own tests, never pass them: a missing, extra, misplaced or
malformed result line fails its test. A test that prints past the output
limit ends "output truncated"; a test the run did not reach (a time limit, an
``os._exit``) has failed.
"""

from __future__ import annotations

import collections
import json
import re
from dataclasses import dataclass
from typing import Any

from .problems import Problem, Test
from ..sandbox import Limits, RunResult, RunStatus, run_python

__all__ = ["Verdict", "extract_code", "judge"]

_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)
_SHOWN = 300  # characters of an input, output or error shown in a verdict
_MARK = "@@ragen-result@@ "  # starts a result line; not a secret: a forged line can only fail a test

# The child: the same script for every submission; the code, the inputs and the mark come on its stdin.
_HARNESS = r'''
import contextlib, io, json, sys
_JOB = json.loads(sys.stdin.read())
_MARK, _KIND, _FUNC, _LIMIT = _JOB["mark"], _JOB["kind"], _JOB["func"], _JOB["output_bytes"]
_out = sys.stdout

class _OutputLimit(BaseException):
    pass

class _Capped(io.StringIO):
    def write(self, text):
        if self.tell() + len(text) > _LIMIT:
            raise _OutputLimit()
        return super().write(text)

def _send(i, key, value):
    _out.write("\n" + _MARK + json.dumps({"i": i, key: value}) + "\n")
    _out.flush()

def _error(exc):
    if isinstance(exc, _OutputLimit):
        return "it printed too much"
    return type(exc).__name__ + ": " + str(exc)[:300]

try:
    _compiled = compile(_JOB["code"], "solution.py", "exec")
    if _KIND == "call":
        _scope = {"__name__": "solution"}
        with contextlib.redirect_stdout(_Capped()):
            exec(_compiled, _scope)
        _fn = _scope[_FUNC] if _FUNC in _scope else getattr(_scope["Solution"](), _FUNC)
except BaseException as exc:
    _send(None, "did_not_run", _error(exc))
    sys.exit(0)
for _i, _input in enumerate(_JOB["inputs"]):
    _buf = _Capped()
    try:
        if _KIND == "call":
            with contextlib.redirect_stdout(_buf):
                _got = json.dumps(_fn(*_input))
            if len(_got) > _LIMIT:
                raise _OutputLimit()
            _out.write("\n" + _MARK + '{"i": %d, "got": %s}' % (_i, _got) + "\n")  # serialized once, sized
            _out.flush()
        else:
            sys.stdin = io.TextIOWrapper(io.BytesIO(_input.encode()), encoding="utf-8")  # .buffer too
            with contextlib.redirect_stdout(_buf):
                try:
                    exec(_compiled, {"__name__": "__main__"})
                except SystemExit as exc:
                    if exc.code not in (None, 0):
                        raise
            _send(_i, "got", _buf.getvalue())
    except _OutputLimit:
        _send(_i, "limit", "output")
    except BaseException as exc:
        _send(_i, "error", _error(exc))
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
    """``code`` run on ``problem``'s test inputs in one sandboxed run, its results compared here."""
    job = {"mark": _MARK, "kind": problem.kind, "func": problem.func_name, "code": code,
           "inputs": [t.input for t in problem.tests], "output_bytes": limits.output_bytes}
    run = run_python(_HARNESS, json.dumps(job), limits)
    results, did_not_run = _read(run.stdout, len(problem.tests))
    ok = [_passes(problem.kind, t, r) for t, r in zip(problem.tests, results)]
    return Verdict(sum(ok), len(problem.tests), run.status, _feedback(problem, results, ok, did_not_run, run),
                   run.cpu_s)


def _read(stdout: str, total: int) -> tuple[list[dict], str | None]:
    """Each test's result from the child's result lines, up to the last test the run reached, and why the
    code did not run at all, when it did not.

    Test k's result is the k-th result line when that line names test k and no other line does; else
    ``{"malformed": True}``. Only whole lines count: a line cut by the output limit is no result."""
    records = [_parse(line[len(_MARK):]) for line in stdout.split("\n")[:-1] if line.startswith(_MARK)]
    first = records[0] if records else None
    if isinstance(first, dict) and first.keys() == {"i", "did_not_run"} and first["i"] is None \
            and isinstance(first["did_not_run"], str):
        return ([{"error": first["did_not_run"]}] if total == 1 else []), first["did_not_run"]
    named = collections.Counter(r["i"] for r in records if isinstance(r, dict) and type(r.get("i")) is int)
    return [r if _valid(r, k) and named[k] == 1 else {"malformed": True}
            for k, r in enumerate(records[:total])], None


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, too deep, or an integer past Python's digit limit
        return None


def _valid(record: Any, k: int) -> bool:
    if not (isinstance(record, dict) and len(record) == 2 and type(record.get("i")) is int and record["i"] == k):
        return False
    key = next(key for key in record if key != "i")
    return (key == "got" or (key == "error" and isinstance(record[key], str))
            or (key == "limit" and record[key] == "output"))


def _norm(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _passes(kind: str, test: Test, result: dict | None) -> bool:
    """Whether ``result`` holds ``test``'s expected output: a return value equal as JSON data, or stdout equal
    line by line."""
    if result is None or "got" not in result:
        return False
    got = result["got"]
    try:
        if kind == "call":
            return got == json.loads(json.dumps(test.expected))
        return isinstance(got, str) and _norm(got) == _norm(test.expected)
    except RecursionError:  # nested deeper than the expected output
        return False


def _feedback(problem: Problem, results: list[dict], ok: list[bool], did_not_run: str | None,
              run: RunResult) -> str:
    """The verdict in words; ``ok``: whether each test the run reached passed."""
    total, passed = len(problem.tests), sum(ok)
    if passed == total:
        return f"All {total} tests passed."
    words = f"Passed {passed}/{total} tests."
    if did_not_run is not None and total != 1:
        return f"{words} Your code did not run: {_short(did_not_run)}"
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
        if ok[i]:
            continue
        result = results[i]
        if "malformed" in result:
            return f"{words} First failing test, {shown}: its result was malformed."
        if "limit" in result:
            return f"{words} First failing test, {shown}: output truncated: it printed too much."
        if "error" in result:
            return f"{words} First failing test, {shown}: raised {_short(result['error'])}."
        expected, got = test.expected, result["got"]
        if problem.kind == "call":
            return f"{words} First failing test: {shown} returned {_short(got)}, expected {_short(expected)}."
        return f"{words} First failing test, {shown}: printed {_short(got)!r}, expected {_short(expected)!r}."
    return words
