"""An env defined outside the ragen package, loaded by import path in the registry tests.

``MyEnv`` has no config class of its own (it is built from the plain dict);
``MyEnvWithConfig`` names ``MyEnvConfig`` through ``config_cls``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragen.env.base import BaseDiscreteActionEnv, BaseEnvConfig, make_rng
from ragen.env.config_checks import check_int


@dataclass
class MyEnvConfig(BaseEnvConfig):
    limit: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        self.limit = check_int("limit", self.limit, minimum=1)


class MyEnv(BaseDiscreteActionEnv):
    """Count up to a limit; action 1 adds one, action 2 waits."""

    ACTION_LOOKUP = {1: "Add", 2: "Wait"}

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        if isinstance(config, dict):
            self.limit = int(config.get("limit", 3))
        elif config is None:
            self.limit = 3
        else:
            self.limit = config.limit
        self.count = 0

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        _, rng = make_rng(seed)
        self.count = int(rng.integers(0, self.limit))
        return f"count {self.count} of {self.limit}"

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        valid = self.is_valid_action(action)
        if valid and action == 1:
            self.count += 1
        done = self.count >= self.limit
        info = {"action_is_valid": valid, "action_is_effective": valid and action == 1, "success": done}
        return f"count {self.count} of {self.limit}", float(done), done, info


class MyEnvWithConfig(MyEnv):
    config_cls = MyEnvConfig


@dataclass
class StrictConfig(BaseEnvConfig):
    """A config that validates with a plain ValueError, as many user configs do."""

    limit: int = 3

    def __post_init__(self) -> None:
        raise ValueError("boom: this config rejects everything")
