"""The FrozenLake env: walk from the start to the goal across ice with holes.

Concepts:

- **Map**: ``size`` rows of tiles, ``S`` start (top left), ``F`` frozen,
  ``H`` hole, ``G`` goal (bottom right). ``generate_map`` draws each tile
  frozen with probability ``p`` and keeps only maps with a path from start to
  goal (after a bounded number of draws it carves one, so every map is
  solvable). The map depends only on its seed: ``config.map_seed`` if set,
  else the reset seed, so the members of an env group share it.
- **Action**: an id of ``ACTION_LOOKUP`` (1 Left, 2 Down, 3 Right, 4 Up), as in
  RAGEN. On slippery ice the move goes the intended way or to either side,
  each with probability 1/3 (gymnasium's rule), drawn from the env's own RNG
  (seeded by the reset seed). Moving off the map leaves the player in place.
- **Reward**: 1 on reaching the goal (``success``); the episode ends in a hole,
  on the goal, or after ``max_steps`` steps.
- **Observation**: the map as text, one row per line, with ``grid_lookup``
  codes 0 player, 1 frozen, 2 hole, 3 goal, 4 player in hole, 5 player on goal.

An action that is not an id leaves everything as it is and does not count as a
step: ``info["action_is_valid"]`` is False and the episode goes on.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache
from typing import Any

import numpy as np

from ..base import make_rng, unchanged_step
from ..grid import GridEnv
from ..render import coordinates
from .config import FrozenLakeEnvConfig

__all__ = ["FrozenLakeEnv", "generate_map"]

# action id -> (row, col) change; gymnasium's 0..3 are our ids 1..4
_MOVES = {1: (0, -1), 2: (1, 0), 3: (0, 1), 4: (-1, 0)}
# draws of a random map before carving a path into the last one
_MAP_DRAWS = 100
# grid_lookup codes
_PLAYER, _FROZEN, _HOLE, _GOAL, _PLAYER_IN_HOLE, _PLAYER_ON_GOAL = range(6)
_TILE_CODE = {"S": _FROZEN, "F": _FROZEN, "H": _HOLE, "G": _GOAL}


def _has_path(board: list[list[str]]) -> bool:
    size = len(board)
    seen = {(0, 0)}
    queue = deque([(0, 0)])
    while queue:
        r, c = queue.popleft()
        if board[r][c] == "G":
            return True
        for dr, dc in _MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < size and 0 <= nc < size and (nr, nc) not in seen and board[nr][nc] != "H":
                seen.add((nr, nc))
                queue.append((nr, nc))
    return False


@lru_cache(maxsize=1024)
def generate_map(size: int, p: float, seed: int) -> tuple[str, ...]:
    """A solvable ``size`` x ``size`` map for ``seed`` (pure; memoised, immutable)."""
    _, rng = make_rng(seed)
    board: list[list[str]] = []
    for _ in range(_MAP_DRAWS):
        frozen = rng.random((size, size)) < p
        board = [["F" if f else "H" for f in row] for row in frozen.tolist()]
        board[0][0], board[-1][-1] = "S", "G"
        if _has_path(board):
            return tuple("".join(row) for row in board)
    # Low p on a big map rarely yields a path by chance: carve a random
    # monotone (right/down) path into the last draw instead of looping on.
    r = c = 0
    while (r, c) != (size - 1, size - 1):
        if c == size - 1 or (r < size - 1 and rng.random() < 0.5):
            r += 1
        else:
            c += 1
        if board[r][c] == "H":
            board[r][c] = "F"
    return tuple("".join(row) for row in board)


class FrozenLakeEnv(GridEnv):
    """FrozenLake: walk from start to goal on a generated map without falling in a hole; the ice may be slippery."""

    config_cls = FrozenLakeEnvConfig
    ACTION_LOOKUP = {1: "Left", 2: "Down", 3: "Right", 4: "Up"}

    def __init__(self, config: FrozenLakeEnvConfig | None = None) -> None:
        super().__init__(config if config is not None else FrozenLakeEnvConfig())
        self.seed: int | None = None
        self.np_random: np.random.Generator | None = None
        self.desc: tuple[str, ...] | None = None
        self.player_pos: tuple[int, int] = (0, 0)
        self.num_env_steps = 0
        self._done = False

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        self.seed, self.np_random = make_rng(seed)
        map_seed = self.config.map_seed if self.config.map_seed is not None else self.seed
        self.desc = generate_map(self.config.size, self.config.p, map_seed)
        self.player_pos = (0, 0)
        self.num_env_steps = 0
        self._done = False
        return self.render()

    @property
    def s(self) -> int:
        """The player's tile as gymnasium's flat state index."""
        return self.player_pos[0] * self.config.size + self.player_pos[1]

    def _tile(self) -> str:
        r, c = self.player_pos
        return self.desc[r][c]

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        if self.desc is None:
            raise RuntimeError("FrozenLakeEnv.step() called before reset()")
        valid = self.is_valid_action(action)
        if not valid or self._done:
            return unchanged_step(self.render(), valid, self._done, self._tile() == "G", self.config.invalid_act_score)

        action = int(action)
        if self.config.is_slippery:
            # intended direction or one of its two perpendiculars, 1/3 each
            ids = list(_MOVES)
            i = ids.index(action)
            action = ids[(i + int(self.np_random.integers(-1, 2))) % 4]
        dr, dc = _MOVES[action]
        size = self.config.size
        r, c = self.player_pos
        nr, nc = min(max(r + dr, 0), size - 1), min(max(c + dc, 0), size - 1)
        moved = (nr, nc) != (r, c)
        self.player_pos = (nr, nc)
        self.num_env_steps += 1
        tile = self._tile()
        success = tile == "G"
        reward = 1.0 if success else 0.0
        self._done = tile in ("G", "H") or self.num_env_steps >= self.config.max_steps
        info = {"action_is_valid": True, "action_is_effective": moved, "success": success}
        return self.render(), reward, self._done, info

    def _started(self) -> bool:
        return self.desc is not None

    def _grid(self) -> str:
        lookup = self.GRID_LOOKUP
        pr, pc = self.player_pos
        lines = []
        for r, row in enumerate(self.desc):
            codes = [_TILE_CODE[t] for t in row]
            if r == pr:
                tile = row[pc]
                codes[pc] = _PLAYER_IN_HOLE if tile == "H" else _PLAYER_ON_GOAL if tile == "G" else _PLAYER
            lines.append("".join(lookup[code] for code in codes))
        return "\n".join(lines)

    def _coordinates(self) -> str:
        def cells(tile: str) -> list[tuple[int, int]]:
            return [(r, c) for r, row in enumerate(self.desc) for c, t in enumerate(row) if t == tile]

        return coordinates([("Player", [self.player_pos]), ("Start", cells("S")), ("Goal", cells("G")),
                            ("Holes", cells("H"))], len(self.desc), len(self.desc[0]))
