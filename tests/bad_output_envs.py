"""An env whose reset/step return values the loop must refuse (tests/test_env_outputs.py).

``BadOutputEnv`` is ``FaultEnv`` (a counter walked to 0) that, when its seed is
``bad_seed``, returns one bad value: ``nan_reward`` (a NaN reward from step),
``str_reward`` (the reward as text), ``huge_reward`` (``huge``, 1e308, at each
step: finite, but two of them sum to inf), ``obj_observation`` (a list as
step's observation) or ``obj_reset`` (a dict from reset).
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.fault_envs import FaultEnv, FaultEnvConfig, _CounterEnv

BAD_OUTPUTS = ("none", "nan_reward", "str_reward", "huge_reward", "obj_observation", "obj_reset")


@dataclass
class BadOutputEnvConfig(FaultEnvConfig):
    bad: str = "none"
    bad_seed: int = -1
    huge: float = 1e308

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bad not in BAD_OUTPUTS:
            raise ValueError(f"bad: unknown {self.bad!r}")


class BadOutputEnv(FaultEnv):
    def __init__(self, config: BadOutputEnvConfig | None = None) -> None:
        super().__init__(config or BadOutputEnvConfig())

    def _bad(self, what: str) -> bool:
        return self.config.bad == what and self.seed == self.config.bad_seed

    def reset(self, seed=None, **kwargs):
        obs = super().reset(seed, **kwargs)
        return {"text": obs} if self._bad("obj_reset") else obs

    def step(self, action):
        obs, reward, done, info = super().step(action)
        if self._bad("nan_reward"):
            reward = float("nan")
        elif self._bad("str_reward"):
            reward = str(reward)
        elif self._bad("huge_reward"):
            reward = self.config.huge
        elif self._bad("obj_observation"):
            obs = ["value", self.value]
        return obs, reward, done, info


class NanRewardEnv(_CounterEnv):
    """For the env checker: every step's reward is NaN."""

    def step(self, action):
        obs, _, done, info = super().step(action)
        return obs, float("nan"), done, info
