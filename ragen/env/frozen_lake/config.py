"""Configuration of the FrozenLake env (RAGEN's ``FrozenLakeEnvConfig`` fields).

``size`` is the side of the square map, ``p`` the probability that a tile is
frozen (not a hole), ``is_slippery`` makes moves slide sideways with
probability 2/3 as in gymnasium, ``map_seed`` fixes one map for every episode
(otherwise each reset seed draws its own map), ``max_steps`` ends an episode
that has not reached the goal or a hole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base import BaseEnvConfig
from ..config_checks import EnvConfigError, check_bool, check_int, check_number
from ..grid import check_grid_settings

__all__ = ["FrozenLakeEnvConfig"]


def _default_grid_lookup() -> dict[int, str]:
    # 0 player, 1 frozen (start included), 2 hole, 3 goal, 4 player in hole, 5 player on goal
    return {0: "P", 1: "_", 2: "O", 3: "G", 4: "X", 5: "√"}


def _default_grid_vocab() -> dict[str, str]:
    return {
        "P": "player",
        "_": "empty",
        "O": "hole",
        "G": "goal",
        "X": "player in hole",
        "√": "player on goal",
    }


def _default_action_lookup() -> dict[int, str]:
    return {1: "Left", 2: "Down", 3: "Right", 4: "Up"}


@dataclass
class FrozenLakeEnvConfig(BaseEnvConfig):
    """FrozenLake's settings: the map (size, frozen probability, seed), slipperiness, step limit
    and how the grid is written."""

    size: int = 4
    p: float = 0.8
    is_slippery: bool = True
    map_seed: int | None = None
    max_steps: int = 100
    render_mode: str = "text"
    observation_format: str = "grid"
    grid_lookup: dict[int, str] = field(default_factory=_default_grid_lookup)
    grid_vocab: dict[str, str] = field(default_factory=_default_grid_vocab)
    action_lookup: dict[int, str] = field(default_factory=_default_action_lookup)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.size = check_int("size", self.size, minimum=2, maximum=64)
        self.p = check_number("p", self.p, maximum=1.0)
        if self.p <= 0.0:
            raise EnvConfigError("p", f"the frozen probability must be in (0, 1], got {self.p}")
        self.is_slippery = check_bool("is_slippery", self.is_slippery)
        if self.map_seed is not None:
            self.map_seed = check_int("map_seed", self.map_seed)
        self.max_steps = check_int("max_steps", self.max_steps, minimum=1)
        check_grid_settings(self, codes=6)
