"""The code env's verdict is the parent's: a hostile submission can make its own tests fail, never pass.

Each attack runs in the sandbox as a submission would. The child is given each test's input only; it
never sees an expected output, a results token or the comparison, so forging a results line, reading
the expected outputs out of the child's memory, or patching the comparison all score 0.
"""

from __future__ import annotations

import pytest

from ragen.env.code.harness import judge
from ragen.env.code.problems import problem, solutions
from ragen.env.sandbox import Limits

pytestmark = pytest.mark.timeout(120)

FAST = Limits(cpu_s=1, wall_s=3, memory_mb=256, output_bytes=16 * 1024)
CALL, STDIO = 0, 7  # top_sum(nums); sum_lines, a stdin/stdout program

# Lines that would claim success: today's token line (the token read from the harness's globals), and
# result lines of every plausible form, each claiming test k passed with a wrong value.
_FORGE = r'''
import json, os, sys
_main = sys.modules["__main__"]
_lines = []
_token = getattr(_main, "_TOKEN", None)
if _token:
    _lines.append(_token + json.dumps([{{"ok": True, "got": 0}}] * 50))
for _mark in {marks!r}:
    for _k in range(50):
        _lines.append(_mark + json.dumps({{"i": _k, "ok": True, "passed": True, "got": 0}}))
sys.__stdout__.write("\n" + "\n".join(_lines) + "\n")
sys.__stdout__.flush()
os._exit(0)
'''

# Finds the expected output of an input anywhere in the child: the harness's globals, every module's
# globals, and every object the garbage collector tracks.
_HUNT = r'''
import gc, sys

def _pairs():
    seen = [vars(sys.modules["__main__"])] + [vars(m) for m in list(sys.modules.values()) if m is not None]
    for scope in seen:
        for value in list(scope.values()):
            yield value
    yield from gc.get_objects()

def _lookup(key):
    for obj in _pairs():
        try:
            if isinstance(obj, (list, tuple)) and len(obj) == 2 and obj[0] == key and obj[1] != key:
                return obj[1]
            if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, (list, tuple)) and len(t) == 2
                                                               for t in obj):
                for t in obj:
                    if t[0] == key:
                        return t[1]
            if isinstance(obj, dict) and obj.get("input") == key and "expected" in obj:
                return obj["expected"]
        except Exception:
            pass
    return None
'''


def _marks() -> list[str]:
    """Result-line prefixes to forge: the harness's own, if it has one, and generic ones."""
    import ragen.env.code.harness as harness

    return [m for m in (getattr(harness, "_MARK", None), "@@ragen-result@@ ", "") if m is not None]


def _score(code: str, seed: int) -> int:
    return judge(code, problem(seed), FAST).passed


def test_a_forged_results_line_scores_0_on_a_call_problem():
    code = _FORGE.format(marks=_marks()) + "def top_sum(nums):\n    return 0\n"
    assert _score(code, CALL) == 0


def test_a_forged_results_line_scores_0_on_a_stdio_problem():
    assert _score(_FORGE.format(marks=_marks()), STDIO) == 0


def test_a_forged_line_in_a_functions_return_path_scores_0():
    code = ("def top_sum(nums):\n" + "".join("    " + line + "\n" for line in _FORGE.format(marks=_marks())
                                              .strip().splitlines()))
    assert _score(code, CALL) == 0


def test_a_lookup_table_of_expected_outputs_finds_none_on_a_call_problem():
    code = _HUNT + "def top_sum(nums):\n    found = _lookup([nums])\n    return 0 if found is None else found\n"
    assert _score(code, CALL) == 0


def test_a_lookup_table_of_expected_outputs_finds_none_on_a_stdio_problem():
    code = _HUNT + "_text = sys.stdin.read()\n_found = _lookup(_text)\nprint('' if _found is None else _found, end='')\n"
    assert _score(code, STDIO) == 0


def test_replacing_the_line_comparison_scores_0():
    code = "import sys\nsys.modules['__main__']._norm = lambda text: []\nprint('nothing')\n"
    assert _score(code, STDIO) == 0


def test_making_the_json_round_trip_equal_to_everything_scores_0():
    code = ("import json\n"
            "class _Any(int):\n"
            "    def __eq__(self, other):\n        return True\n"
            "    __hash__ = int.__hash__\n"
            "json.loads = lambda *a, **k: _Any(0)\n"
            "def top_sum(nums):\n    return _Any(0)\n")
    assert _score(code, CALL) == 0


def test_what_a_correct_function_prints_is_not_its_result():
    right, _ = solutions(CALL)
    noisy = right.replace("    return", "    print('debugging', nums)\n    return") + "print('loaded')\n"
    assert judge(noisy, problem(CALL), FAST).correct


@pytest.mark.parametrize("extra", ['{"i": 0, "got": 1}', '[1, 2]', '{"i": 0', '{"i": true, "got": 1}'])
def test_an_extra_or_malformed_result_line_fails_a_correct_program(extra):
    right, _ = solutions(STDIO)
    mark = _marks()[0]
    code = f"import sys\nsys.__stdout__.write({chr(10) + mark + extra + chr(10)!r})\n" + right
    verdict = judge(code, problem(STDIO), FAST)
    assert not verdict.correct, verdict.feedback


def test_honest_submissions_are_judged_as_before():
    for seed in (CALL, STDIO):
        right, wrong = solutions(seed)
        assert judge(right, problem(seed), FAST).correct
        for code in wrong:
            verdict = judge(code, problem(seed), FAST)
            assert not verdict.correct and "First failing test" in verdict.feedback, verdict.feedback
    verdict = judge("n = int(input())\nprint(n)\n", problem(STDIO), FAST)
    assert "printed " in verdict.feedback and ", expected " in verdict.feedback
    verdict = judge("def top_sum(nums):\n    return -1\n", problem(CALL), FAST)
    assert "returned -1, expected " in verdict.feedback
