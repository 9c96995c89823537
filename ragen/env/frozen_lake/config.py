"""Configuration of the FrozenLake env: RAGEN's ``FrozenLakeEnvConfig`` fields and defaults.

``size`` is the side of the square map and ``p`` the probability that a tile
is frozen (not a hole). On slippery ice (``is_slippery``) a move goes the
intended way with probability ``success_rate`` and to either side with half
the rest. ``map_seed`` is accepted as in RAGEN, where ``reset(seed)`` replaces
it with the reset seed: the map always follows the reset seed. ``action_map``
maps action ids to gymnasium's directions (0 Left, 1 Down, 2 Right, 3 Up),
``map_lookup`` tiles (``P``, ``F``, ``H``, ``G``) to the cell codes that
``grid_lookup`` writes (0 player, 1 frozen, 2 hole, 3 goal, 4 player in hole,
5 player on goal).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..base import BaseEnvConfig
from ..config_checks import EnvConfigError, check_bool, check_int, check_number
from ..grid import check_grid_settings

__all__ = ["FrozenLakeEnvConfig"]

# the tiles map_lookup names (RAGEN keys them as bytes; YAML gives strings)
MAP_TILES = ("P", "F", "H", "G")


def _default_action_map() -> dict[int, int]:
    return {1: 0, 2: 1, 3: 2, 4: 3}


def _default_map_lookup() -> dict[str, int]:
    return {"P": 0, "F": 1, "H": 2, "G": 3}


def _default_grid_lookup() -> dict[int, str]:
    return {0: "P", 1: "_", 2: "O", 3: "G", 4: "X", 5: "√"}


def _default_grid_vocab() -> dict[str, str]:
    return {"P": "player", "_": "empty", "O": "hole", "G": "goal", "X": "player in hole", "√": "player on goal"}


def _default_action_lookup() -> dict[int, str]:
    return {1: "Left", 2: "Down", 3: "Right", 4: "Up"}


def _int_key(field_name: str, key: object) -> int:
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, numbers.Integral):
        raise EnvConfigError(field_name, f"ids must be integers, got {key!r}")
    return int(key)


def check_action_map(value: object, ids: list[int]) -> dict[int, int]:
    """``{action id: gymnasium direction 0..3}`` over exactly the ids of ``action_lookup``."""
    if not isinstance(value, Mapping):
        raise EnvConfigError("action_map", f"expected a mapping of action ids to directions 0..3, got {value!r}")
    out = {}
    for k, v in value.items():
        out[_int_key("action_map", k)] = check_int(f"action_map.{k}", v, minimum=0, maximum=3)
    if sorted(out) != sorted(ids):
        raise EnvConfigError("action_map", f"ids must be those of action_lookup, {sorted(ids)}, got {sorted(out)}")
    return out


def check_map_lookup(value: object) -> dict[str, int]:
    """``{tile: cell code}`` for exactly the tiles P, F, H, G (str or bytes keys)."""
    if not isinstance(value, Mapping):
        raise EnvConfigError("map_lookup", f"expected a mapping of tiles P, F, H, G to codes, got {value!r}")
    out = {}
    for k, v in value.items():
        tile = k.decode() if isinstance(k, bytes) else k
        if tile not in MAP_TILES:
            raise EnvConfigError("map_lookup", f"tiles must be {list(MAP_TILES)}, got {k!r}")
        out[tile] = check_int(f"map_lookup.{tile}", v)
    if sorted(out) != sorted(MAP_TILES):
        raise EnvConfigError("map_lookup", f"tiles must be exactly {list(MAP_TILES)}, got {sorted(out)}")
    return out


@dataclass
class FrozenLakeEnvConfig(BaseEnvConfig):
    """FrozenLake's settings (RAGEN's fields): the map's size and frozen probability,
    slipperiness, and how actions and tiles are named and written."""

    size: int = 4
    p: float = 0.9
    success_rate: float = 0.8
    is_slippery: bool = True
    map_seed: int | None = None
    render_mode: str = "text"
    observation_format: str = "grid"
    action_map: dict[int, int] = field(default_factory=_default_action_map)
    map_lookup: dict[str, int] = field(default_factory=_default_map_lookup)
    grid_lookup: dict[int, str] = field(default_factory=_default_grid_lookup)
    grid_vocab: dict[str, str] = field(default_factory=_default_grid_vocab)
    action_lookup: dict[int, str] = field(default_factory=_default_action_lookup)

    def __post_init__(self) -> None:
        super().__post_init__()
        # size 1 has no room for a goal apart from the start: RAGEN's map draw never ends
        self.size = check_int("size", self.size, minimum=2, maximum=64)
        self.p = check_number("p", self.p, minimum=0.0, maximum=1.0)
        self.success_rate = check_number("success_rate", self.success_rate, minimum=0.0, maximum=1.0)
        self.is_slippery = check_bool("is_slippery", self.is_slippery)
        if self.map_seed is not None:
            self.map_seed = check_int("map_seed", self.map_seed)
        check_grid_settings(self, codes=6)
        self.action_map = check_action_map(self.action_map, list(self.action_lookup))
        self.map_lookup = check_map_lookup(self.map_lookup)
