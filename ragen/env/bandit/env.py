"""The two-armed bandit env (RAGEN's BanditEnv semantics).

Concepts:

- **Arms**: a low-risk arm (fixed reward) and a high-risk arm (a high reward
  with some probability, else a low one), known to the agent only by their
  symbolic names. ``ACTION_LOOKUP`` is ``{start: lo name, start + 1: hi name}``
  for the whole life of the instance, so an action id always means the same arm
  (with ``config.split``, the names are drawn per episode; ids keep their order:
  ``start`` is the low-risk arm).
- **Observation**: the game rules naming both arms; the order in which the
  arms are named is shuffled per episode by the env's RNG, so position carries
  no signal. After the pull: ``"<arm>: <reward> points"``.
- **Episode**: one pull. ``success`` is choosing the high-risk arm (the better
  arm in expectation with the default scores), as in RAGEN.

The reward draw uses the env's own RNG seeded by the reset seed, so members of
one group (same seed) that pull the same arm get the same reward. (RAGEN mixes
a process-wide instance counter into the seed to vary it; that is global state
and breaks reproducibility, so it is not copied here.)

An action that is not an id (e.g. the arm's name as text) does not pull:
``info["action_is_valid"]`` is False and the episode goes on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base import BaseDiscreteActionEnv, make_rng, unchanged_step
from .config import ARM_NAME_PAIRS, BanditEnvConfig

__all__ = ["BanditEnv"]

INIT_PROMPT = (
    "You are playing a bandit game. Goal: maximize your total reward by choosing which arm to pull.\n"
    "Game rules:\n"
    "1. There are 2 arms, named {name_a} and {name_b}.\n"
    "2. Each arm has its own reward distribution, related to its name.\n"
    "3. Analyze the symbolic meaning of each arm's name to guess how its reward distribution might behave.\n"
    "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher "
    "rewards on average? Choose between {name_a} and {name_b}, and output like <answer> {name_a} </answer> "
    "or <answer> {name_b} </answer>."
)


class BanditEnv(BaseDiscreteActionEnv):
    """A one-pull two-armed bandit whose arms are known only by their names; action ids pick the arm."""

    config_cls = BanditEnvConfig

    def __init__(self, config: BanditEnvConfig | None = None) -> None:
        super().__init__(config if config is not None else BanditEnvConfig())
        cfg = self.config
        start = cfg.action_space_start
        self.lo_arm_name = cfg.lo_arm_name
        self.hi_arm_name = cfg.hi_arm_name
        self.ACTION_LOOKUP = {start: cfg.lo_arm_name, start + 1: cfg.hi_arm_name}
        self.render_mode = cfg.render_mode
        self.seed: int | None = None
        self.np_random: np.random.Generator | None = None
        self.render_cache: str | None = None
        self._done = False
        self._success = False

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        self.seed, self.np_random = make_rng(seed)
        if self.config.split is not None:
            pairs = ARM_NAME_PAIRS[self.config.split]
            self.lo_arm_name, self.hi_arm_name = pairs[int(self.np_random.integers(len(pairs)))]
            start = self.config.action_space_start
            self.ACTION_LOOKUP = {start: self.lo_arm_name, start + 1: self.hi_arm_name}
        names = [self.lo_arm_name, self.hi_arm_name]
        if self.np_random.random() < 0.5:
            names.reverse()
        self.render_cache = INIT_PROMPT.format(name_a=names[0], name_b=names[1])
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
        self.render_cache = f"{arm}: {reward} points"
        self._done = True
        self._success = arm == self.hi_arm_name
        info = {"action_is_valid": True, "action_is_effective": True, "success": self._success}
        return self.render_cache, reward, True, info

    def render(self, mode: str | None = None) -> str:
        return self.render_cache or ""
