"""The FrozenLake env: walk from the start to the goal across ice with holes (RAGEN's episodes).

Concepts:

- **Map**: ``size`` rows of tiles, ``S`` start, ``F`` frozen, ``H`` hole,
  ``G`` goal. ``generate_map(size, p, seed)`` gives RAGEN's map for a seed:
  from ``numpy.random.default_rng(seed)`` (gymnasium's seeding) it draws every
  tile (frozen with probability ``p``), then the start and the goal cells, and
  draws again until start and goal differ and a path joins them. The reset
  seed picks the map, so the members of an env group share it.
- **Action**: an id of ``ACTION_LOOKUP`` (1 Left, 2 Down, 3 Right, 4 Up),
  turned into gymnasium's direction by ``action_map``. Each step draws one
  uniform number from the env's own generator (``default_rng(reset seed)``,
  after one draw for the start, as gymnasium's ``FrozenLakeEnv`` does): on
  slippery ice it picks the direction to the left of the intended one, the
  intended one or the one to its right with probabilities
  ``(1 - success_rate) / 2``, ``success_rate``, ``(1 - success_rate) / 2``.
  Moving off the map leaves the player in place.
- **Reward**: 1 on reaching the goal (``success``); the episode ends in a hole
  or on the goal.
- **Observation**: ``observation_format`` ``grid`` (the map, one row per line,
  with ``map_lookup`` and ``grid_lookup``), ``coord`` (the board size, then the
  start, goal, player and holes as ``(row, col)``) or ``grid_coord`` (both).

An action that is not an id leaves everything as it is and does not count as a
step: ``info["action_is_valid"]`` is False and the episode goes on.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from ..base import make_rng, unchanged_step
from ..grid import GridEnv
from ..render import OBSERVATION_FORMATS
from .config import FrozenLakeEnvConfig

__all__ = ["FrozenLakeEnv", "generate_map"]

# gymnasium's directions 0 Left, 1 Down, 2 Right, 3 Up as (row, col) changes
_DIRECTIONS = ((0, -1), (1, 0), (0, 1), (-1, 0))
# grid_lookup codes of the player on a tile
_PLAYER, _PLAYER_IN_HOLE, _PLAYER_ON_GOAL = 0, 4, 5


def _goal_reachable(board: list[list[str]], start: tuple[int, int]) -> bool:
    size = len(board)
    seen = {start}
    stack = [start]
    while stack:
        r, c = stack.pop()
        for dr, dc in _DIRECTIONS:
            nr, nc = r + dr, c + dc
            if 0 <= nr < size and 0 <= nc < size and (nr, nc) not in seen:
                tile = board[nr][nc]
                if tile == "G":
                    return True
                if tile != "H":
                    seen.add((nr, nc))
                    stack.append((nr, nc))
    return False


@lru_cache(maxsize=4096)
def generate_map(size: int, p: float, seed: int) -> tuple[str, ...]:
    """RAGEN's map for ``seed`` (memoised, immutable): rows of ``S``, ``F``, ``H``, ``G``.

    A negative seed (which numpy refuses) is taken mod 2**64, as ``make_rng`` does."""
    rng = np.random.default_rng(seed % 2**64 if seed < 0 else seed)
    # numpy's choice(["F", "H"], p=[p, 1 - p]) is "F" where a uniform draw is
    # below its normalised cumulative probability; the same arithmetic here
    cdf = np.cumsum(np.array([p, 1 - p], dtype=np.float64))
    frozen_below = float(cdf[0] / cdf[-1])
    while True:
        frozen = rng.random((size, size)) < frozen_below
        start = tuple(int(v) for v in rng.integers(size, size=2))
        goal = tuple(int(v) for v in rng.integers(size, size=2))
        if start == goal:
            continue
        board = [["F" if f else "H" for f in row] for row in frozen.tolist()]
        board[start[0]][start[1]] = "S"
        board[goal[0]][goal[1]] = "G"
        if _goal_reachable(board, start):
            return tuple("".join(row) for row in board)


class FrozenLakeEnv(GridEnv):
    """FrozenLake: walk from start to goal on the seed's map without falling in a hole; the ice may be slippery."""

    config_cls = FrozenLakeEnvConfig
    ACTION_LOOKUP = {1: "Left", 2: "Down", 3: "Right", 4: "Up"}

    def __init__(self, config: FrozenLakeEnvConfig | None = None) -> None:
        super().__init__(config if config is not None else FrozenLakeEnvConfig())
        cfg = self.config
        self.action_map = dict(cfg.action_map)
        self.MAP_LOOKUP = dict(cfg.map_lookup)
        fail = (1.0 - cfg.success_rate) / 2.0
        # cumulative probabilities of (left of intended, intended, right of intended), summed as numpy's cumsum does
        self._slip_cdf = (fail, fail + cfg.success_rate, fail + cfg.success_rate + fail)
        self.seed: int | None = None
        self.np_random: np.random.Generator | None = None
        self.desc: tuple[str, ...] | None = None
        self.player_pos: tuple[int, int] = (0, 0)

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        self.seed, self.np_random = make_rng(seed)
        self.desc = generate_map(self.config.size, self.config.p, self.seed)
        self.player_pos = next((r, row.index("S")) for r, row in enumerate(self.desc) if "S" in row)
        self.np_random.random()  # gymnasium draws the start from the (one-cell) start distribution
        return self.render()

    @property
    def s(self) -> int:
        """The player's tile as gymnasium's flat state index."""
        return self.player_pos[0] * len(self.desc[0]) + self.player_pos[1]

    def _tile(self) -> str:
        r, c = self.player_pos
        return self.desc[r][c]

    def is_valid_action(self, action: Any) -> bool:
        return super().is_valid_action(action) and int(action) in self.action_map

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        if self.desc is None:
            raise RuntimeError("FrozenLakeEnv.step() called before reset()")
        valid = self.is_valid_action(action)
        tile = self._tile()
        if not valid or tile in "GH":
            return unchanged_step(self.render(), valid, tile in "GH", tile == "G", self.config.invalid_act_score)

        direction = self.action_map[int(action)]
        u = self.np_random.random()
        if self.config.is_slippery:
            # gymnasium: the first of the cumulative probabilities above u (the first one if none is)
            i = next((k for k, bound in enumerate(self._slip_cdf) if bound > u), 0)
            direction = (direction + i - 1) % 4
        dr, dc = _DIRECTIONS[direction]
        size = len(self.desc)
        r, c = self.player_pos
        self.player_pos = (min(max(r + dr, 0), size - 1), min(max(c + dc, 0), size - 1))
        tile = self._tile()
        success = tile == "G"
        info = {"action_is_effective": self.player_pos != (r, c), "action_is_valid": True, "success": success}
        return self.render(), 1 if success else 0, tile in "GH", info  # ints, as gymnasium's reward_schedule

    def render(self, mode: str | None = None) -> str:
        if not self._started():
            return ""
        fmt = mode if mode in OBSERVATION_FORMATS else self.config.observation_format
        if mode not in (None, "text") and mode not in OBSERVATION_FORMATS:
            raise ValueError(f"render mode must be 'text' or one of {list(OBSERVATION_FORMATS)}, got {mode!r}")
        if fmt == "grid":
            return self._grid()
        if fmt == "coord":
            return self._coordinates()
        return f"Coordinates: \n{self._coordinates()}\nGrid Map: \n{self._grid()}"

    def _started(self) -> bool:
        return self.desc is not None

    def _grid(self) -> str:
        lookup, codes = self.GRID_LOOKUP, self.MAP_LOOKUP
        pr, pc = self.player_pos
        lines = []
        for r, row in enumerate(self.desc):
            cells = [lookup.get(codes["F" if t == "S" else t], "?") for t in row]
            if r == pr:
                tile = row[pc]
                code = _PLAYER_IN_HOLE if tile == "H" else _PLAYER_ON_GOAL if tile == "G" else _PLAYER
                cells[pc] = lookup.get(code, "?")
            lines.append("".join(cells))
        return "\n".join(lines)

    def _coordinates(self) -> str:
        def cells(tile: str) -> list[tuple[int, int]]:
            return [(r, c) for r, row in enumerate(self.desc) for c, t in enumerate(row) if t == tile]

        tile = self._tile()
        player = "Player on goal" if tile == "G" else "Player in hole" if tile == "H" else "Player"
        lines = [f"Board size: {len(self.desc)} rows x {len(self.desc[0])} cols (zero-indexed)."]
        for label, where in (("Start", cells("S")), ("Goal", cells("G")), (player, [self.player_pos]),
                             ("Holes", cells("H"))):
            if where:
                lines.append(f"{label}: " + ", ".join(f"({r}, {c})" for r, c in where))
        return "\n".join(lines)
