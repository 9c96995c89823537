"""Envs for fault tests: a small deterministic env that can fail on purpose.

``FaultEnv`` walks a counter from a seed-derived start towards 0 (actions
Up/Down). ``fault`` picks how it fails when its seed is ``fault_seed``:
``raise_reset``, ``raise_step``, ``hang_step`` (sleeps ``hang_s``),
``exit_step`` (``os._exit``), ``kill_step`` (SIGKILL to itself),
``huge_step`` (an observation of ``huge_bytes`` characters). With a
``marker`` path the fault is transient: the first env to fail creates the file
and later calls (the fallback's re-run) behave normally.

``ExitingEnv`` wraps any env and ends its process (``os._exit``) on its
``at_step``-th step after a reset, once (a ``marker`` file says it did): a
worker that dies mid-rollout. ``exiting_group(specs, group, at_step, marker)``
gives a rollout's specs with one group's envs wrapped so.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ragen.env import make_env
from ragen.env.base import BaseDiscreteActionEnv, BaseEnvConfig, reset_takes_mode

FAULTS = ("none", "raise_reset", "raise_step", "hang_step", "exit_step", "kill_step", "huge_step")


@dataclass
class FaultEnvConfig(BaseEnvConfig):
    fault: str = "none"
    fault_seed: int = -1
    marker: str = ""  # transient when set
    hang_s: float = 30.0
    huge_bytes: int = 1 << 20
    max_start: int = 6
    step_cost_s: float = 0.0
    hook: Any = None  # anything, unused: a lock here makes a config that does not pickle
    # the action names the prompt lists (RAGEN reads them from the config class's defaults)
    action_lookup: dict = field(default_factory=lambda: dict(FaultEnv.ACTION_LOOKUP))

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
        if self._fault_now("huge_step"):
            return "x" * self.config.huge_bytes, 0.0, False, {
                "action_is_valid": True, "action_is_effective": False, "success": False}
        if action not in self.ACTION_LOOKUP:
            return self.render(), 0.0, False, {"action_is_valid": False, "action_is_effective": False, "success": False}
        self.value += 1 if action == 1 else -1
        done = self.value == 0
        return self.render(), (1.0 if done else -0.1), done, {
            "action_is_valid": True, "action_is_effective": True, "success": done}

    def render(self, mode="text"):
        return f"value={self.value}"


# ----- a worker that dies mid-rollout --------------------------------------------------

@dataclass
class ExitingEnvConfig:
    """The wrapped env (its tag's ``env_type``, ``config_type`` and ``env_config``), and
    when its process exits: on the ``at_step``-th step after a reset, unless ``marker`` exists."""

    env_type: str
    marker: str
    env_config: dict | None = None
    config_type: str | None = None
    at_step: int = 1


class ExitingEnv:
    """Another env, stepped as it is, whose process exits once at a step (``ExitingEnvConfig``)."""

    def __init__(self, config: ExitingEnvConfig) -> None:
        self.exiting = config
        self.inner = make_env(config.env_type, config.env_config, config.config_type)
        self.steps = 0

    def __getattr__(self, name: str) -> Any:  # ACTION_LOOKUP, config, tools, close: the wrapped env's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self, seed=None, mode=None, **kwargs):
        self.steps = 0
        if reset_takes_mode(type(self.inner)):
            kwargs["mode"] = mode
        return self.inner.reset(seed=seed, **kwargs)

    def step(self, action):
        self.steps += 1
        if self.steps >= self.exiting.at_step and _first_to_create(self.exiting.marker):
            os._exit(3)
        return self.inner.step(action)


def _first_to_create(path: str) -> bool:
    """Creates ``path``; False when it already exists (atomic: one caller of all gets True)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def exiting_group(specs: list, group: int, at_step: int, marker: str) -> list:
    """``specs`` with the envs of their ``group``-th group (in group order) wrapped in
    ``ExitingEnv``: the process that plays the group exits at its ``at_step``-th step, once."""
    group_id = sorted({s.group_id for s in specs})[group]
    return [replace(s, env_type="tests.fault_envs:ExitingEnv", config_type="tests.fault_envs:ExitingEnvConfig",
                    env_config={"env_type": s.env_type, "config_type": s.config_type, "env_config": s.env_config,
                                "at_step": at_step, "marker": marker})
            if s.group_id == group_id else s for s in specs]


# ----- broken envs for the env checker (tests/test_env_check.py) -------------------
# Each breaks one rule of the engine's env contract; the checker must name it.

class _CounterEnv(BaseDiscreteActionEnv):
    """A correct little env the broken ones below derive from: walk to 0."""

    ACTION_LOOKUP = {1: "Up", 2: "Down"}

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.value = 0

    def _start(self, seed) -> int:
        return int(np.random.default_rng(seed).integers(1, 50))

    def reset(self, seed=None, **kwargs):
        self.value = self._start(seed)
        return f"value={self.value}"

    def _info(self, valid: bool, done: bool) -> dict:
        return {"action_is_valid": valid, "action_is_effective": valid, "success": done}

    def step(self, action):
        if not self.is_valid_action(action):
            return f"value={self.value}", 0.0, False, self._info(False, False)
        self.value += 1 if action == 1 else -1
        done = self.value == 0
        return f"value={self.value}", float(done), done, self._info(True, done)


class GlobalRngEnv(_CounterEnv):
    """RAGEN's old pattern: seeds and draws from numpy's global generator."""

    def _start(self, seed) -> int:
        np.random.seed(seed)
        return int(np.random.randint(1, 50))

    def step(self, action):
        obs, reward, done, info = super().step(action)
        return obs + f" wind={np.random.randint(3)}", reward, done, info


class UnseededEnv(_CounterEnv):
    """Non-deterministic: its generator ignores the seed."""

    def _start(self, seed) -> int:
        return int(np.random.default_rng().integers(1, 10**9))


class SharedStateEnv(_CounterEnv):
    """Keeps its move history in a class-level list: shared by every instance."""

    history: list = []

    def reset(self, seed=None, **kwargs):
        self.history.clear()
        return super().reset(seed) + " moves=0"

    def step(self, action):
        self.history.append(action)
        obs, reward, done, info = super().step(action)
        return obs + f" moves={len(self.history)}", reward, done, info


class WrongTypesEnv(_CounterEnv):
    """gymnasium's API instead of RAGEN's: (obs, info) from reset, 5-tuples from step."""

    def reset(self, seed=None, **kwargs):
        return super().reset(seed), {}

    def step(self, action):
        obs, reward, done, info = super().step(action)
        return obs, reward, done, False, info


class LooseTypesEnv(_CounterEnv):
    """The right shape with wrong types: reward as text, done as an int."""

    def step(self, action):
        obs, reward, done, info = super().step(action)
        return obs, str(reward), int(done), info


class MissingInfoEnv(_CounterEnv):
    def step(self, action):
        obs, reward, done, _ = super().step(action)
        return obs, reward, done, {"won": done}


class LockEnv(_CounterEnv):
    """An attribute that does not pickle: a lock."""

    def __init__(self, config=None) -> None:
        super().__init__(config)
        import threading

        self.lock = threading.Lock()


class LambdaEnv(_CounterEnv):
    """An attribute that does not pickle: a lambda."""

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.reward_fn = lambda done: float(done)


class RaisingOnInvalidEnv(_CounterEnv):
    def step(self, action):
        name = self.ACTION_LOOKUP[action]  # KeyError for an unknown id
        return super().step(1 if name == "Up" else 2)


class EmptyLookupEnv(_CounterEnv):
    ACTION_LOOKUP: dict = {}


class ConstantEnv(_CounterEnv):
    """Ignores the seed: every env group would play the same episode (a warning)."""

    def _start(self, seed) -> int:
        return 5
