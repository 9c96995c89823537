"""FrozenLake with a synthetic cost per reset and step, for benchmarks of the rollout's timing.

``env_type: ragen.env.timed:TimedFrozenLakeEnv``. Each reset and step waits a
time drawn lognormal (``cost_median_s``, ``cost_sigma``) from the env's seed
and the call's index, times ``time_scale``: the same cost for the same episode
in every process and order. The wait is a sleep, so it holds no CPU (an env
whose work runs elsewhere: a simulator, a sandbox, a remote judge). The
episode is FrozenLake's, unchanged.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

from ragen.env.config_checks import EnvConfigError
from ragen.env.frozen_lake import FrozenLakeEnv, FrozenLakeEnvConfig


@dataclass
class TimedFrozenLakeEnvConfig(FrozenLakeEnvConfig):
    """FrozenLake's settings, and the lognormal cost of each reset and step."""

    cost_median_s: float = 0.005
    cost_sigma: float = 1.0
    cost_max_s: float = 1.0  # before time_scale
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("cost_median_s", "cost_max_s", "time_scale"):
            if not getattr(self, name) > 0:
                raise EnvConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.cost_sigma >= 0:
            raise EnvConfigError(f"cost_sigma must be >= 0, got {self.cost_sigma!r}")


class TimedFrozenLakeEnv(FrozenLakeEnv):
    """FrozenLake whose reset and steps each take a seeded lognormal time."""

    config_cls = TimedFrozenLakeEnvConfig

    def __init__(self, config: TimedFrozenLakeEnvConfig | None = None) -> None:
        super().__init__(config or TimedFrozenLakeEnvConfig())
        self._episode_seed = 0
        self._calls = 0

    def _wait(self) -> None:
        c = self.config
        draw = random.Random(f"{self._episode_seed},{self._calls}").gauss(0.0, 1.0)
        self._calls += 1
        time.sleep(min(c.cost_max_s, c.cost_median_s * math.exp(c.cost_sigma * draw)) * c.time_scale)

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        self._episode_seed, self._calls = seed or 0, 0
        self._wait()
        return super().reset(seed=seed, **kwargs)

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        self._wait()
        return super().step(action)
