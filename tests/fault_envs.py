"""Envs for fault tests: a small deterministic env that can fail on purpose.

``FaultEnv`` walks a counter from a seed-derived start towards 0 (actions
Up/Down). ``fault`` picks how it fails when its seed is ``fault_seed``:
``raise_reset``, ``raise_step``, ``hang_step`` (sleeps ``hang_s``),
``exit_step`` (``os._exit``), ``kill_step`` (SIGKILL to itself). With a
``marker`` path the fault is transient: the first env to fail creates the file
and later calls (the fallback's re-run) behave normally.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import numpy as np

from ragen.env.base import BaseDiscreteActionEnv, BaseEnvConfig

FAULTS = ("none", "raise_reset", "raise_step", "hang_step", "exit_step", "kill_step")


@dataclass
class FaultEnvConfig(BaseEnvConfig):
    fault: str = "none"
    fault_seed: int = -1
    marker: str = ""  # transient when set
    hang_s: float = 30.0
    max_start: int = 6
    step_cost_s: float = 0.0

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"fault: unknown {self.fault!r}")


class FaultEnv(BaseDiscreteActionEnv):
    ACTION_LOOKUP = {1: "Up", 2: "Down"}

    def __init__(self, config: FaultEnvConfig | None = None) -> None:
        super().__init__(config or FaultEnvConfig())
        self.value = 0
        self.seed = None

    def _fault_now(self, where: str) -> bool:
        cfg = self.config
        if not cfg.fault.startswith(where) or self.seed != cfg.fault_seed:
            return False
        if cfg.marker:
            if os.path.exists(cfg.marker):
                return False
            with open(cfg.marker, "w") as f:
                f.write(str(os.getpid()))
        return True

    def reset(self, seed=None, **kwargs):
        self.seed = seed
        rng = np.random.default_rng(seed)
        self.value = int(rng.integers(1, self.config.max_start + 1))
        if self._fault_now("raise_reset"):
            raise RuntimeError("injected reset failure")
        return self.render()

    def step(self, action):
        if self.config.step_cost_s:
            time.sleep(self.config.step_cost_s)
        if self._fault_now("raise_step"):
            raise RuntimeError("injected step failure")
        if self._fault_now("hang_step"):
            time.sleep(self.config.hang_s)
        if self._fault_now("exit_step"):
            os._exit(7)
        if self._fault_now("kill_step"):
            os.kill(os.getpid(), signal.SIGKILL)
        if action not in self.ACTION_LOOKUP:
            return self.render(), 0.0, False, {"action_is_valid": False, "action_is_effective": False, "success": False}
        self.value += 1 if action == 1 else -1
        done = self.value == 0
        return self.render(), (1.0 if done else -0.1), done, {
            "action_is_valid": True, "action_is_effective": True, "success": done}

    def render(self, mode="text"):
        return f"value={self.value}"
