"""The two-armed bandit env (RAGEN's episodes).

Concepts:

- **Arms**: a low-risk arm (fixed reward) and a high-risk arm (a high reward
  with some probability, else a low one), known to the agent only by their
  symbolic names, a pair drawn per episode from the split's ``ARM_NAMES``.
- **Draws** (RAGEN's, from the env's own ``default_rng(reset seed)``): one
  uniform number picks the pair (by index), a second one the ids: below 0.5
  the low-risk arm gets ``action_space_start``, else the high-risk one does.
  Pulling the high-risk arm draws a third for its reward.
- **Observation**: RAGEN's game rules naming the arm of the first id, then the
  second. After the pull: ``"<arm>: <reward> points"``.
- **Episode**: one pull. ``success`` is choosing the high-risk arm (the better
  arm in expectation with the default scores).

RAGEN adds a per-process count of its env instances to the reset seed; that
is global state, so here the reset seed alone decides (RAGEN's first
instance), and the members of a group see the same arms.

An action that is not an id (e.g. the arm's name as text) does not pull:
``info["action_is_valid"]`` is False and the episode goes on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base import BaseDiscreteActionEnv, make_rng, unchanged_step
from .config import ARM_NAMES, BanditEnvConfig

__all__ = ["BanditEnv"]

INIT_PROMPT = (
    "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
    "Game Rules: \n"
    "1. There are 2 arms, named {name_a} and {name_b}\n"
    "2. Each arm has its own reward distribution, related to their names. \n"
    "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.\n"
    "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher "
    "rewards on average? Choose between {name_a} and {name_b}, and output like <answer> {name_a} </answer> "
    "or <answer> {name_b} </answer>.\n"
)


class BanditEnv(BaseDiscreteActionEnv):
    """A one-pull two-armed bandit whose arms are known only by their names; action ids pick the arm."""

    config_cls = BanditEnvConfig

    def __init__(self, config: BanditEnvConfig | None = None) -> None:
        super().__init__(config if config is not None else BanditEnvConfig())
        self.ACTION_LOOKUP: dict[int, str] = {}
        self.render_mode = self.config.render_mode
        self.lo_arm_name: str | None = None
        self.hi_arm_name: str | None = None
        self.seed: int | None = None
        self.np_random: np.random.Generator | None = None
        self.render_cache: str | None = None
        self._done = False
        self._success = False

    def get_all_actions(self) -> list[int]:
        start = self.config.action_space_start
        return [start, start + 1]

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        self.seed, self.np_random = make_rng(seed)
        pairs = ARM_NAMES[self.config.split]
        self.lo_arm_name, self.hi_arm_name = pairs[int(self.np_random.random() * len(pairs))]
        start = self.config.action_space_start
        first, second = (self.lo_arm_name, self.hi_arm_name)
        if self.np_random.random() >= 0.5:
            first, second = second, first
        self.ACTION_LOOKUP = {start: first, start + 1: second}
        self.render_cache = INIT_PROMPT.format(name_a=first, name_b=second)
        self._done = False
        self._success = False
        return self.render_cache

    def compute_reward(self, action: int) -> float:
        if self.ACTION_LOOKUP[action] == self.lo_arm_name:
            return self.config.lo_arm_score
        if self.np_random.random() < self.config.hi_arm_hiscore_prob:
            return self.config.hi_arm_hiscore
        return self.config.hi_arm_loscore

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        if self.render_cache is None:
            raise RuntimeError("BanditEnv.step() called before reset()")
        valid = self.is_valid_action(action)
        if not valid or self._done:
            return unchanged_step(self.render_cache, valid, self._done, self._success, self.config.invalid_act_score)
        action = int(action)
        reward = self.compute_reward(action)
        arm = self.ACTION_LOOKUP[action]
        self.render_cache = f"{arm}: {reward} points"  # the score as configured: "2 points"
        self._done = True
        self._success = arm == self.hi_arm_name
        info = {"action_is_effective": True, "action_is_valid": True, "success": self._success}
        return self.render_cache, reward, True, info  # the score as configured (int or float), as in RAGEN

    def render(self, mode: str | None = None) -> str:
        return self.render_cache or ""
