"""The code env: write a program, and it runs against tests in a sandbox.

Concepts:

- **Problem**: ``problems.problem(seed)``, a statement and its tests (calls of
  a function with expected return values, or stdin with the stdout expected);
  the seed alone decides it. With ``dataset_path``, problem ``seed % N`` of a
  DeepCoder file (``deepcoder.py``).
- **Action**: the answer's code (the first fenced block of the answer, else
  the answer itself); with ``tool_calls``, the ``code`` of a ``run_tests``
  call (its first fenced block, else all of it).
- **Step**: the code run once against every test (``harness.judge``) in a
  sandboxed subprocess: CPU, memory, wall and output limits, its own temporary
  folder, no inherited environment, and (as root) no network and nothing left
  running after it (``sandbox.py``).
- **Observation**: at reset the statement; after a submission the verdict:
  the tests passed, and the first failing test (its input, what the code gave
  and what was expected, or "time limit exceeded", "memory limit exceeded",
  "output truncated"), so a later attempt can repair it.
- **Reward**: the score of a submission is the fraction of tests passed
  (``reward: fraction``) or 1 when all pass (``all``); a step's reward is the
  rise of the best score so far, so an episode's rewards sum to its best
  score. ``success``: every test passed. With ``attempts: 1`` (the default)
  one submission ends the episode; with more, a failed one shows its verdict
  and the episode goes on.
"""

from __future__ import annotations

from typing import Any

from ..base import BaseLanguageBasedEnv, make_rng, tool_argument, unchanged_step
from .config import CodeEnvConfig
from .harness import Verdict, extract_code, judge
from .deepcoder import load_problems
from .problems import Problem, problem

__all__ = ["CodeEnv"]


class CodeEnv(BaseLanguageBasedEnv):
    """One programming problem per episode, its submissions run in a sandbox."""

    config_cls = CodeEnvConfig

    def __init__(self, config: CodeEnvConfig | None = None) -> None:
        super().__init__(config if config is not None else CodeEnvConfig())
        self.problem: Problem | None = None
        self.attempts_left = 0
        self.best = 0.0
        self.render_cache = ""
        self._done = False
        self._success = False

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        seed, _ = make_rng(seed)
        if self.config.dataset_path is None:
            self.problem = problem(seed)
        else:
            problems = load_problems(self.config.dataset_path)
            self.problem = problems[seed % len(problems)]
        self.attempts_left = self.config.attempts
        self.best = 0.0
        self._done = self._success = False
        self.render_cache = self.problem.statement
        return self.render_cache

    def score(self, verdict: Verdict) -> float:
        if self.config.reward == "all":
            return 1.0 if verdict.correct else 0.0
        return verdict.passed / verdict.total

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        if self.problem is None:
            raise RuntimeError("CodeEnv.step() called before reset()")
        self.step_costs = None
        if isinstance(action, dict):  # a tool call
            action = tool_argument(action, "run_tests", "code")
        code = extract_code(action) if isinstance(action, str) else ""
        if not code.strip() or self._done:
            return unchanged_step(self.render_cache, bool(code.strip()), self._done, self._success,
                                  self.config.invalid_act_score)
        verdict = judge(code, self.problem, self.config.limits())
        self.step_costs = {"sandbox_cpu_s": verdict.cpu_s}
        score = self.score(verdict)
        reward = max(0.0, score - self.best)
        self.best = max(self.best, score)
        self.attempts_left -= 1
        self._success = verdict.correct
        self._done = self._success or self.attempts_left == 0
        self.render_cache = verdict.feedback
        if not self._done:
            left = self.attempts_left
            self.render_cache += f" Fix the code and submit it again ({left} attempt{'s' if left > 1 else ''} left)."
        info = {"action_is_effective": True, "action_is_valid": True, "success": self._success,
                "tests_passed": verdict.passed, "tests_total": verdict.total, "run_status": verdict.status.value}
        return self.render_cache, reward, self._done, info

    def render(self, mode: str | None = None) -> str:
        return self.render_cache
