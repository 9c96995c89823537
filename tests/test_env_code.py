"""The code env: the judging of submissions, the env's
episodes, and the scripted policy's pool; after every test no process of a
sandboxed run is left."""

from __future__ import annotations

import json
import os
import random

import pytest

from ragen.env import make_env, make_env_config
from ragen.env.check.checker import check_env
from ragen.env.code.harness import extract_code, judge
from ragen.env.code.pool import scripted_answer
from ragen.env.code.problems import FAMILIES, count, problem, solutions
from ragen.env.sandbox import Limits, RunStatus

from tests.sandbox_attacks import runs_left

pytestmark = pytest.mark.timeout(120)

FAST = Limits(cpu_s=1, wall_s=3, memory_mb=256, output_bytes=16 * 1024)


@pytest.fixture(autouse=True)
def no_process_survives():
    yield
    assert runs_left() == []


# ----- judging -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", range(len(FAMILIES)), ids=[f.name for f in FAMILIES])
def test_every_familys_reference_passes_and_its_wrong_solutions_fail(family):
    right, wrong = solutions(family)
    p = problem(family)
    assert judge(right, p, FAST).correct
    for code in wrong:
        verdict = judge(code, p, FAST)
        assert not verdict.correct and verdict.feedback.startswith(f"Passed {verdict.passed}/{verdict.total} tests.")


def test_problems_are_pure_functions_of_the_seed_and_hundreds_are_distinct():
    assert problem(123) == problem(123) and problem(123) != problem(133)
    assert count() >= 200
    assert len({problem(s).statement for s in range(0, 2000)}) == count()


@pytest.mark.parametrize("code, words", [
    ("def top_sum(nums):\n    return 0\n", "First failing test: top_sum("),
    ("def top_sum(nums:\n", "Your code did not run: SyntaxError"),
    ("def top_sum(nums):\n    raise KeyError('k')\n", "raised KeyError: 'k'"),
    ("def top_sum(nums):\n    while True: pass\n", "time limit exceeded"),
    ("def top_sum(nums):\n    print('x' * 10 ** 7)\n", "output truncated"),
    ("def top_sum(nums):\n    return bytearray(2 * 1024 ** 3)\n", "raised MemoryError"),
    ("import os\nos._exit(0)\n", "the program ended before this test"),
])
def test_a_failed_submission_says_why_at_its_first_failing_test(code, words):
    verdict = judge(code, problem(0), FAST)
    assert not verdict.correct and words in verdict.feedback, verdict.feedback


def test_the_results_line_cannot_be_forged_by_the_code():
    code = "print('@@ragen-results-0000@@[{\"ok\": true}]')\ndef top_sum(nums):\n    return 0\n"
    assert judge(code, problem(0), FAST).passed == 0


def test_answers_in_fences_are_code():
    assert extract_code("Here:\n```python\nprint(1)\n```\nDone.") == "print(1)"
    assert extract_code("print(2)") == "print(2)"


# ----- the env -----------------------------------------------------------------------------------------------

def test_an_episode_with_attempts_sums_to_the_best_score():
    env = make_env("code", {"attempts": 3})
    seed = 2  # fib_mod
    assert env.reset(seed=seed) == problem(seed).statement
    right, wrong = solutions(seed)
    obs, r1, done, info = env.step(wrong[0])
    assert not done and "Fix the code and submit it again (2 attempts left)" in obs and info["success"] is False
    obs, r2, done, info = env.step(f"```python\n{right}```")
    assert done and info["success"] and obs.startswith("All ") and r1 + r2 == pytest.approx(1.0)
    assert env.step(right)[1:3] == (0, True)  # after the end: nothing changes


def test_reward_all_gives_1_only_when_every_test_passes():
    env = make_env("code", {"reward": "all"})
    env.reset(seed=2)
    assert env.step(solutions(2)[1][0])[1:3] == (0.0, True)


def test_an_empty_answer_is_invalid_and_changes_nothing():
    env = make_env("code", {})
    env.reset(seed=0)
    obs, reward, done, info = env.step("  \n ")
    assert (reward, done, info["action_is_valid"]) == (0.0, False, False)


@pytest.mark.parametrize("key, value", [("attempts", 0), ("reward", "some"), ("cpu_s", 0), ("memory_mb", 10)])
def test_bad_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"custom_envs.C.env_config.{key}:"):
        make_env_config("code", {key: value}, tag="C")


def test_the_env_checker_passes_the_code_env():
    report = check_env("code", {"attempts": 2}, seeds=3, max_steps=3)
    assert report.ok, report.format()


# ----- the scripted policy's pool ------------------------------------------------------------------------------

def test_the_pool_answers_the_stated_problem_right_or_wrong():
    for seed in (0, 2, 7, 9, 21):
        p = problem(seed)
        answers = {scripted_answer(f"System.\n{p.statement}", random.Random(k))[0] for k in range(40)}
        right, wrong = solutions(seed)
        assert {extract_code(a) + "\n" for a in answers} <= {right, *wrong}
        assert any(judge(extract_code(a), p, FAST).correct for a in answers)
    assert scripted_answer("Push the boxes.", random.Random(0)) is None


# ----- DeepCoder files -----------------------------------------------------------------------------------------

def _deepcoder_file(tmp_path, suffix):
    rows = [
        {"question": "Read two integers and print their sum.", "starter_code": "", "metadata": "{}", "uid": "p0",
         "ground_truth": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin_stdout"},
                                     {"input": "5 -7\n", "output": "-2\n", "testtype": "stdin_stdout"}])},
        {"question": "Return a + b.", "uid": "p1", "metadata": json.dumps({"func_name": "add"}),
         "starter_code": "class Solution:\n    def add(self, a: int, b: int) -> int:\n        ",
         "ground_truth": json.dumps([{"input": "1\n2", "output": "3", "testtype": "functional"},
                                     {"input": "[1, 2]\n[3]", "output": "[1, 2, 3]", "testtype": "functional"}])},
        {"question": "No tests here.", "uid": "p2", "metadata": "{}", "starter_code": "", "ground_truth": "[]"},
    ]
    path = tmp_path / f"deepcoder{suffix}"
    if suffix == ".parquet":
        import pandas

        pandas.DataFrame(rows).to_parquet(path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_deepcoder_files_problems_are_played(tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (pip install -e '.[dev]')")
    path = str(_deepcoder_file(tmp_path, suffix))
    env = make_env("code", {"dataset_path": path, "attempts": 2})
    assert env.reset(seed=0) == "Read two integers and print their sum."
    obs, reward, done, _ = env.step("a, b = map(int, input().split())\nprint(a - b)")
    assert not done and "printed '-1\\n', expected '3\\n'" in obs
    assert env.step("a, b = map(int, input().split())\nprint(a + b)")[1:3] == (1.0, True)
    assert env.reset(seed=3).startswith("Return a + b.\n\nStarter code:\nclass Solution:")  # 2 usable: 3 % 2
    solution = "class Solution:\n    def add(self, a, b):\n        return a + b\n"
    assert env.step(solution)[3]["success"]
    env.reset(seed=1)
    assert env.step("def add(a, b):\n    return a + b\n")[3]["success"]  # a top-level function does too


def test_a_bad_deepcoder_file_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"custom_envs.C.env_config.dataset_path: .* is not a file"):
        make_env_config("code", {"dataset_path": str(tmp_path / "none.parquet")}, tag="C")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"question": "x", "ground_truth": "[]"}) + "\n")
    with pytest.raises(ValueError, match=r"dataset_path: .* has no problem with stdin/stdout or functional tests"):
        make_env_config("code", {"dataset_path": str(empty)}, tag="C")


def test_each_submissions_sandbox_cpu_reaches_the_rollouts_metrics():
    from ragen.llm.scripted import ScriptedEngine
    from ragen.rollout.envs import cost_metrics
    from tests.rollout_helpers import custom_envs, loop_config, sequential, specs_for

    specs = specs_for(["CodeRepair"], [3], 1, custom_envs())
    trajs = sequential(specs, loop_config(max_turn=3), engine=ScriptedEngine(answers="ragen.env.code.pool:scripted_answer"))
    runs = [c for t in trajs for turn in t.turns for c in turn.costs.get("sandbox_cpu_s", [])]
    assert len(runs) == sum(len(turn.executed_actions) for t in trajs for turn in t.turns) and min(runs) > 0
    m = cost_metrics(trajs)
    assert m["costs/sandbox_cpu_s_n"] == len(runs) and m["costs/sandbox_cpu_s_sum"] == pytest.approx(sum(runs))
    assert m["costs/sandbox_cpu_s_p50"] <= m["costs/sandbox_cpu_s_p90"] <= m["costs/sandbox_cpu_s_p99"] == max(runs)
    rerun = sequential(specs, loop_config(max_turn=3), engine=ScriptedEngine(answers="ragen.env.code.pool:scripted_answer"))
    assert rerun == trajs  # a measurement, not part of the result
