"""Small envs written the way RAGEN's own env modules are (mll-lab-nu/RAGEN,
``ragen/env/*/env.py``), so the tests meet every pattern a RAGEN user's module
relies on, without copying RAGEN's code:

- ``LakeOnGymnasium``: gymnasium's ``FrozenLakeEnv`` as a second base class;
  ``self.config`` and the lookups set *before* ``BaseDiscreteActionEnv.__init__``;
  a default config instance as the argument's default; ``reset`` re-running
  ``self.__init__(self.config)`` under ``with all_seed(seed):``; ``ACTION_LOOKUP``
  keyed from 1; numpy bools and scalars in ``step``'s results; ``render(mode)``
  with several modes.
- ``SokobanOnGymSokoban``: gym-sokoban's ``SokobanEnv`` (on ``gym`` 0.26) as a
  base, whose ``__init__`` resets and whose ``step`` renders ``rgb_array``; room
  generation by gym-sokoban's generator, which draws from the process-global
  ``random`` and ``np.random``, seeded by ``all_seed``; a config whose
  ``__post_init__`` deletes its ``dim_x``/``dim_y`` attributes; retry with
  another seed on ``RuntimeError``.
- ``ArmsOnGymnasium``: ``gymnasium.Env`` as a second base; the base ``__init__``
  called *first* and the config set after (``None`` -> the config's defaults);
  the action lookup drawn in ``reset``, which reads RAGEN's ``mode`` argument
  ("train" or "val"); ``render()`` without a mode.

Their configs do not derive from ``BaseEnvConfig`` (RAGEN's do not either).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymnasiumFrozenLake
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from ragen.env.base import BaseDiscreteActionEnv, BaseLanguageBasedEnv
from ragen.utils import all_seed

# ----------------------------------------------------------------------------
# gymnasium FrozenLake as a second base class


@dataclass
class LakeConfig:
    size: int = 4
    p: float = 0.8
    is_slippery: bool = True
    map_seed: int | None = None
    render_mode: str = "text"
    action_lookup: dict[int, str] = field(default_factory=lambda: {1: "Left", 2: "Down", 3: "Right", 4: "Up"})
    to_gym_action: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 1, 3: 2, 4: 3})
    symbols: dict[bytes, str] = field(default_factory=lambda: {b"S": "_", b"F": "_", b"H": "O", b"G": "G"})


class LakeOnGymnasium(BaseDiscreteActionEnv, GymnasiumFrozenLake):
    def __init__(self, config: LakeConfig = LakeConfig()):  # noqa: B008 (RAGEN's own signature)
        self.config = config
        self.ACTION_LOOKUP = config.action_lookup
        self.render_mode = config.render_mode
        desc = generate_random_map(size=config.size, p=config.p, seed=config.map_seed)
        BaseDiscreteActionEnv.__init__(self)
        GymnasiumFrozenLake.__init__(self, desc=desc, is_slippery=config.is_slippery, render_mode=config.render_mode)

    def reset(self, seed=None, mode=None):
        with all_seed(seed):
            self.config.map_seed = seed
            self.__init__(self.config)
            GymnasiumFrozenLake.reset(self, seed=seed)
        return self.render()

    def step(self, action):
        before = int(self.s)
        _, reward, terminated, _, _ = GymnasiumFrozenLake.step(self, self.config.to_gym_action[action])
        info = {
            "action_is_effective": np.bool_(before != int(self.s)),
            "action_is_valid": True,
            "success": self.desc[self.player_pos] == b"G",  # a numpy bool
            "position": np.int64(self.s),
        }
        return self.render(), np.float64(reward), np.bool_(terminated), info

    @property
    def player_pos(self) -> tuple[int, int]:
        return int(self.s) // self.ncol, int(self.s) % self.ncol

    def render(self, mode=None):
        mode = mode or self.render_mode
        if mode == "text":
            rows = [[self.config.symbols[c] for c in row] for row in self.desc]
            r, c = self.player_pos
            rows[r][c] = "P"
            return "\n".join("".join(row) for row in rows)
        if mode == "coord":
            return f"player at {self.player_pos}"
        raise ValueError(f"Invalid mode: {mode}")


# ----------------------------------------------------------------------------
# gym-sokoban as a base; global RNG under all_seed


@dataclass
class BoxConfig:
    dim_room: tuple[int, int] = (6, 6)
    max_steps: int = 100
    num_boxes: int = 1
    dim_x: int | None = None
    dim_y: int | None = None
    render_mode: str = "text"
    action_lookup: dict[int, str] = field(default_factory=lambda: {1: "Up", 2: "Down", 3: "Left", 4: "Right"})
    symbols: dict[int, str] = field(default_factory=lambda: {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"})

    def __post_init__(self):
        if self.dim_x is not None and self.dim_y is not None:
            self.dim_room = (self.dim_x, self.dim_y)
            delattr(self, "dim_x")
            delattr(self, "dim_y")


def _gym_sokoban():
    from gym_sokoban.envs.room_utils import generate_room
    from gym_sokoban.envs.sokoban_env import SokobanEnv

    return SokobanEnv, generate_room


GymSokobanEnv, generate_room = _gym_sokoban()


class SokobanOnGymSokoban(BaseDiscreteActionEnv, GymSokobanEnv):
    def __init__(self, config=None, **kwargs):
        self.config = config or BoxConfig()
        self.ACTION_LOOKUP = self.config.action_lookup
        self.render_mode = self.config.render_mode
        BaseDiscreteActionEnv.__init__(self)
        GymSokobanEnv.__init__(self, dim_room=self.config.dim_room, max_steps=self.config.max_steps,
                               num_boxes=self.config.num_boxes, **kwargs)

    def reset(self, seed=None, mode=None):
        try:
            with all_seed(seed):
                self.room_fixed, self.room_state, self.box_mapping = generate_room(
                    dim=self.dim_room, num_steps=self.num_gen_steps, num_boxes=self.num_boxes)
        except (RuntimeError, RuntimeWarning):
            return self.reset(None if seed is None else (seed * 7919 + 1) % 2**32)
        self.num_env_steps, self.reward_last, self.boxes_on_target = 0, 0, 0
        self.player_position = np.argwhere(self.room_state == 5)[0]
        return self.render()

    def step(self, action):
        before = self.player_position.copy()
        _, reward, done, _ = GymSokobanEnv.step(self, action)  # renders an rgb_array through self.render
        info = {
            "action_is_effective": not np.array_equal(before, self.player_position),
            "action_is_valid": True,
            "success": self.boxes_on_target == self.num_boxes,
        }
        return self.render(), reward, done, info

    def render(self, mode=None):
        mode = mode or self.render_mode
        if mode == "text":
            room = np.where((self.room_state == 5) & (self.room_fixed == 2), 6, self.room_state)
            return "\n".join("".join(self.config.symbols[int(c)] for c in row) for row in room)
        if mode == "rgb_array":
            return self.get_image(mode="rgb_array", scale=1)
        if mode == "coord":
            return f"player at {tuple(int(x) for x in self.player_position)}"
        raise ValueError(f"Invalid mode: {mode}")


# ----------------------------------------------------------------------------
# gymnasium.Env as a second base; base __init__ first, config after


@dataclass
class ArmsConfig:
    low_score: float = 0.1
    high_score: float = 1.0
    start: int = 1


class ArmsOnGymnasium(BaseDiscreteActionEnv, gymnasium.Env):
    def __init__(self, config=None):
        BaseDiscreteActionEnv.__init__(self)
        self.config = config if config is not None else ArmsConfig()
        self.render_cache = None

    def reset(self, seed=None, mode=None):
        gymnasium.Env.reset(self, seed=seed)
        start = self.config.start
        names = ["gold", "lead"] if self.np_random.random() < 0.5 else ["lead", "gold"]
        self.ACTION_LOOKUP = {start: names[0], start + 1: names[1]}
        self.render_cache = f"Two arms: {names[0]} and {names[1]}. Pull one." + (" (evaluation)" if mode == "val" else "")
        return self.render_cache

    def step(self, action):
        name = self.ACTION_LOOKUP[action]
        reward = np.float32(self.config.high_score if name == "gold" else self.config.low_score)
        self.render_cache = f"{name}: {float(reward)} points"
        return self.render_cache, reward, np.bool_(True), {
            "action_is_effective": True, "action_is_valid": True, "success": np.bool_(name == "gold")}

    def render(self):
        return self.render_cache


# ----------------------------------------------------------------------------
# an env that records how many of its instances run at once (parallel_friendly)


@dataclass
class BusyConfig:
    call_s: float = 0.02


class BusyEnv(BaseLanguageBasedEnv):
    """Each reset and step sleeps ``call_s``; ``max_at_once`` is the most
    instances seen inside a call at the same time (in this process)."""

    _lock = threading.Lock()
    _inside = 0
    max_at_once = 0

    def __init__(self, config=None):
        BaseLanguageBasedEnv.__init__(self, config if config is not None else BusyConfig())
        self.value = 0

    def _busy(self) -> None:
        cls = BusyEnv
        with cls._lock:
            cls._inside += 1
            cls.max_at_once = max(cls.max_at_once, cls._inside)
        time.sleep(self.config.call_s)
        with cls._lock:
            cls._inside -= 1

    def reset(self, seed=None, **kwargs: Any):
        self._busy()
        self.value = int(np.random.default_rng(seed).integers(1, 9))
        return f"value {self.value}"

    def step(self, action):
        self._busy()
        self.value -= 1
        done = self.value <= 0
        return f"value {self.value}", 1.0 if done else 0.0, done, {
            "action_is_valid": True, "action_is_effective": True, "success": done}
