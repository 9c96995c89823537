"""The Sokoban env: gym-sokoban's rules and rewards, RAGEN's text interface.

Concepts:

- **Room**: ``room_fixed`` (0 wall, 1 floor, 2 target) and ``room_state``
  (adds 3 box on target, 4 box, 5 player) numpy arrays, gym-sokoban encoding.
  A room comes from ``ragen_rooms.generate_ragen_room`` (``generator: ragen``,
  the default: RAGEN's room for the seed; RAGEN takes seeds in ``[0, 2**32)``
  only, and other seeds get the room of their value mod ``2**32``) or
  ``generator.generate_room`` (``generator: fast``), and depends only on the
  room settings and the reset seed, so every member of an env group (same
  seed) starts from the same room.
- **Action**: an id of ``ACTION_LOOKUP`` (1 Up, 2 Down, 3 Left, 4 Right). The
  player walks onto free floor, or pushes a box that has free floor behind it.
- **Reward** (gym-sokoban): -0.1 per step, +1 for a box pushed onto a target,
  -1 for a box pushed off one, +10 when every box is on a target (``done``,
  ``success``). The episode also ends after ``max_steps`` steps.
- **Observation**: the grid as text, one row per line, each cell written with
  ``grid_lookup`` (6 = player on target); or RAGEN's coordinate text (targets,
  boxes, boxes on target, player, player on target), or both
  (``observation_format``, see ``ragen.env.render``).

An action that is not an id (text, ``None``, an unknown number) leaves the room
as it is and does not count as a step: ``info["action_is_valid"]`` is False,
the reward is ``config.invalid_act_score`` and the episode goes on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base import make_rng, unchanged_step
from ..grid import GridEnv
from ..render import board_coordinates
from .config import SokobanEnvConfig
from .generator import BOX, BOX_ON_TARGET, FLOOR, PLAYER, TARGET, generate_room
from .ragen_rooms import generate_ragen_room

__all__ = ["SokobanEnv"]

# (row, col) change per action id
_CHANGE = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}
_PLAYER_ON_TARGET = 6

PENALTY_FOR_STEP = -0.1
REWARD_BOX_ON_TARGET = 1.0
PENALTY_BOX_OFF_TARGET = -1.0
REWARD_FINISHED = 10.0


class SokobanEnv(GridEnv):
    """Sokoban: push every box onto a target in a generated room, with gym-sokoban's rewards."""

    config_cls = SokobanEnvConfig
    ACTION_LOOKUP = {1: "Up", 2: "Down", 3: "Left", 4: "Right"}

    def __init__(self, config: SokobanEnvConfig | None = None) -> None:
        super().__init__(config if config is not None else SokobanEnvConfig())
        cfg = self.config
        self.dim_room = tuple(cfg.dim_room)
        self.num_boxes = cfg.num_boxes
        self.max_steps = cfg.max_steps
        self.search_depth = cfg.search_depth
        self.seed: int | None = None
        self.np_random: np.random.Generator | None = None
        self.room_fixed: np.ndarray | None = None
        self.room_state: np.ndarray | None = None
        self.player_position: np.ndarray | None = None
        self.min_pushes = 0
        self.num_env_steps = 0
        self.boxes_on_target = 0
        self.reward_last = 0.0
        self._done = False

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        self.seed, self.np_random = make_rng(seed)
        rows, cols = self.dim_room
        if self.config.generator == "ragen":
            # RAGEN seeds numpy's legacy generator, which takes [0, 2**32) only (RAGEN fails
            # on other seeds); those seeds get the room of their value mod 2**32
            room = generate_ragen_room(rows, cols, self.num_boxes, self.search_depth, self.seed % 2**32)
        else:
            room = generate_room(rows, cols, self.num_boxes, self.search_depth, self.seed)
        # fresh arrays per episode: the memoised room itself is immutable
        self.room_fixed = np.array(room.room_fixed, dtype=np.uint8)
        self.room_state = np.array(room.room_state, dtype=np.uint8)
        self.player_position = np.argwhere(self.room_state == PLAYER)[0]
        self.min_pushes = room.min_pushes
        self.num_env_steps = 0
        self.boxes_on_target = int(np.count_nonzero(self.room_state == BOX_ON_TARGET))
        self.reward_last = 0.0
        self._done = False
        return self.render()

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        if self.room_state is None:
            raise RuntimeError("SokobanEnv.step() called before reset()")
        valid = self.is_valid_action(action)
        if not valid or self._done:  # stepping a finished episode changes nothing and earns nothing
            return unchanged_step(self.render(), valid, self._done, self._success(), self.config.invalid_act_score)

        moved = self._move(int(action))
        self.num_env_steps += 1
        previous_on_target = self.boxes_on_target
        self.boxes_on_target = int(np.count_nonzero(self.room_state == BOX_ON_TARGET))
        reward = PENALTY_FOR_STEP
        if self.boxes_on_target > previous_on_target:
            reward += REWARD_BOX_ON_TARGET
        elif self.boxes_on_target < previous_on_target:
            reward += PENALTY_BOX_OFF_TARGET
        success = self._success()
        if success:
            reward += REWARD_FINISHED
        self._done = success or self.num_env_steps >= self.max_steps
        self.reward_last = reward
        info = {"action_is_valid": True, "action_is_effective": moved, "success": success}
        return self.render(), reward, self._done, info

    def _move(self, action: int) -> bool:
        """Walk or push in the action's direction; whether the player moved."""
        dr, dc = _CHANGE[action]
        state, fixed = self.room_state, self.room_fixed
        r, c = int(self.player_position[0]), int(self.player_position[1])
        nr, nc = r + dr, c + dc
        ahead = state[nr, nc]  # the border is wall, so ahead is always inside
        if ahead in (BOX, BOX_ON_TARGET):
            br, bc = nr + dr, nc + dc
            if state[br, bc] not in (FLOOR, TARGET):
                return False
            state[br, bc] = BOX_ON_TARGET if fixed[br, bc] == TARGET else BOX
        elif ahead not in (FLOOR, TARGET):
            return False
        state[nr, nc] = PLAYER
        state[r, c] = fixed[r, c]
        self.player_position = np.array([nr, nc])
        return True

    def _success(self) -> bool:
        return self.room_state is not None and self.boxes_on_target == self.num_boxes

    def _started(self) -> bool:
        return self.room_state is not None

    def _grid(self) -> str:
        lookup = self.GRID_LOOKUP
        lines = []
        for state_row, fixed_row in zip(self.room_state.tolist(), self.room_fixed.tolist()):
            lines.append(
                "".join(
                    lookup[_PLAYER_ON_TARGET if s == PLAYER and f == TARGET else s]
                    for s, f in zip(state_row, fixed_row)
                )
            )
        return "\n".join(lines)

    def _coordinates(self) -> str:
        def cells(mask: np.ndarray) -> list[tuple[int, int]]:
            return [(int(r), int(c)) for r, c in np.argwhere(mask)]

        state, fixed = self.room_state, self.room_fixed
        player = state == PLAYER
        return board_coordinates([
            ("Targets", cells(fixed == TARGET)),
            ("Boxes", cells(state == BOX)),
            ("Boxes on target", cells(state == BOX_ON_TARGET)),
            ("Player", cells(player & (fixed != TARGET))),
            ("Player on target", cells(player & (fixed == TARGET))),
        ], *state.shape)
