"""The Countdown env: combine the given numbers into an equation for the target.

Concepts:

- **Puzzle**: numbers and a target. ``generate_puzzle`` draws the numbers, then
  folds them in a random order with random operations whose intermediate
  results stay positive integers, and uses the result as the target (kept only
  if it lies in ``1..max_target``); the fold is a known solution, so every
  puzzle is solvable. It is a pure function of the settings and the seed.
- **Action**: the answer text, an equation that uses each number exactly once
  (its value is computed from its syntax tree, never by ``eval``).
- **Reward** (RAGEN's judgement, ``judge``): 0 unless the integers written in
  the answer are exactly the puzzle's numbers; then ``score`` (1) if its value
  is the target (``success``), else ``format_score`` (0.1). One answer ends
  the episode, whatever its text.
- **Observation**: ``"Target: <target>, nums: [<numbers>]"``, then
  ``"Your answer get <reward> points."`` (RAGEN's words).

An action that is not text is invalid: ``info["action_is_valid"]`` is False
and the episode goes on. RAGEN's puzzles come from a data file of its own;
these are generated. ``load_puzzle`` starts an episode on a given puzzle.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from ..base import BaseLanguageBasedEnv, make_rng, unchanged_step
from .config import CountdownEnvConfig
from .judge import ragen_correct, ragen_numbers_match

__all__ = ["CountdownEnv", "CountdownPuzzle", "generate_puzzle"]

# Folds tried per seed; about a third land in range even for small max_target.
_MAX_DRAWS = 10_000


class CountdownPuzzle(NamedTuple):
    """One puzzle: the numbers, the target, and one equation that reaches it."""

    numbers: tuple[int, ...]
    target: int
    solution: str


def _fold(numbers: list[int], rng: np.random.Generator) -> tuple[int, str]:
    """Combine the numbers pairwise in random order; (value, expression)."""
    items = [(n, str(n)) for n in numbers]
    while len(items) > 1:
        i, j = (int(k) for k in rng.choice(len(items), size=2, replace=False))
        (a, ea), (b, eb) = items[i], items[j]
        for k in sorted((i, j), reverse=True):
            items.pop(k)
        # only operations whose result is a positive integer, as in the game
        ops = ["+", "*"]
        if a != b:
            ops.append("-")
        if (b > 1 and a % b == 0) or (a > 1 and b % a == 0):
            ops.append("/")
        op = ops[int(rng.integers(len(ops)))]
        if (op == "-" and a < b) or (op == "/" and not (b > 1 and a % b == 0)):
            (a, ea), (b, eb) = (b, eb), (a, ea)
        if op == "+":
            value = a + b
        elif op == "*":
            value = a * b
        elif op == "-":
            value = a - b
        else:
            value = a // b
        items.append((value, f"({ea} {op} {eb})"))
    value, expr = items[0]
    return value, expr[1:-1] if expr.startswith("(") else expr


@lru_cache(maxsize=4096)
def generate_puzzle(num_count: int, max_number: int, max_target: int, seed: int) -> CountdownPuzzle:
    """The puzzle for ``seed`` (pure, memoised): numbers, target and one solution."""
    _, rng = make_rng(seed)
    for _ in range(_MAX_DRAWS):
        numbers = [int(n) for n in rng.integers(1, max_number + 1, size=num_count)]
        target, solution = _fold(numbers, rng)
        if 1 <= target <= max_target:
            return CountdownPuzzle(tuple(numbers), target, solution)
    raise RuntimeError(
        f"no Countdown target in 1..{max_target} from {num_count} numbers up to {max_number} for seed {seed}"
    )


class CountdownEnv(BaseLanguageBasedEnv):
    """Countdown: one answer, an equation of the given numbers, judged against the target."""

    config_cls = CountdownEnvConfig

    def __init__(self, config: CountdownEnvConfig | None = None) -> None:
        super().__init__(config if config is not None else CountdownEnvConfig())
        self.render_mode = self.config.render_mode
        self.seed: int | None = None
        self.np_random: np.random.Generator | None = None
        self.puzzle: CountdownPuzzle | None = None
        self.render_cache: str | None = None
        self._done = False
        self._success = False

    @property
    def numbers(self) -> list[int]:
        return list(self.puzzle.numbers) if self.puzzle else []

    @property
    def target(self) -> int | None:
        return self.puzzle.target if self.puzzle else None

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        self.seed, self.np_random = make_rng(seed)
        cfg = self.config
        return self.load_puzzle(generate_puzzle(cfg.num_count, cfg.max_number, cfg.max_target, self.seed))

    def load_puzzle(self, puzzle: CountdownPuzzle) -> str:
        """Start an episode on ``puzzle``; the first observation."""
        self.puzzle = puzzle
        self.render_cache = f"Target: {puzzle.target}, nums: {list(puzzle.numbers)}"
        self._done = False
        self._success = False
        return self.render_cache

    def compute_reward(self, action: Any) -> float:
        """RAGEN's score for an answer: score, format_score or 0."""
        if not ragen_numbers_match(action, self.puzzle.numbers):
            return 0
        return self.config.score if ragen_correct(action, self.puzzle.target) else self.config.format_score

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        if self.puzzle is None:
            raise RuntimeError("CountdownEnv.step() called before reset()")
        valid = isinstance(action, str)
        if not valid or self._done:
            return unchanged_step(self.render_cache, valid, self._done, self._success, self.config.invalid_act_score)
        reward = self.compute_reward(action)
        self._done, self._success = True, reward == self.config.score
        self.render_cache = f"Your answer get {reward} points."  # the score as configured: "1 points"
        info = {"action_is_effective": reward > 0, "action_is_valid": True, "success": self._success}
        return self.render_cache, reward, True, info  # int 0 or the configured score, as in RAGEN

    def render(self, mode: str | None = None) -> str:
        return self.render_cache or ""
