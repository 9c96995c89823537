"""Shortest Sokoban solutions by breadth-first search over moves.

Concepts:

- **Move**: one action of the env (Up/Down/Left/Right); it walks the player or,
  with a box ahead and free floor behind it, pushes the box. The length of a
  solution counts every move, pushes included; this is the difficulty measure
  the benchmarks report (RAGEN's figures count the same way).
- **State**: (player cell, box mask), with cells numbered row-major as in
  ``generator``. The BFS is exact, so the first solved state popped gives a
  shortest solution.

Used by the tests (every generated room must be solvable) and by
``benchmarks/sokoban_generation.py``; not on the env's hot path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from .generator import BOX, BOX_ON_TARGET, PLAYER, TARGET, WALL

__all__ = ["solve"]

# Action ids as in SokobanEnv.ACTION_LOOKUP: 1 Up, 2 Down, 3 Left, 4 Right.
_ACTIONS = (1, 2, 3, 4)


def solve(
    room_fixed: np.ndarray | Sequence[Sequence[int]],
    room_state: np.ndarray | Sequence[Sequence[int]],
    max_states: int = 2_000_000,
) -> list[int] | None:
    """A shortest list of action ids that solves the room, or ``None``.

    ``None`` means no solution exists or the search visited ``max_states``
    states without finding one. ``[]`` means the room is already solved.
    """
    fixed = np.asarray(room_fixed).tolist()
    state = np.asarray(room_state).tolist()
    rows, cols = len(fixed), len(fixed[0])
    walls = targets = boxes = 0
    player = -1
    for r in range(rows):
        for c in range(cols):
            bit = 1 << (r * cols + c)
            if fixed[r][c] == WALL:
                walls |= bit
            elif fixed[r][c] == TARGET:
                targets |= bit
            if state[r][c] in (BOX, BOX_ON_TARGET):
                boxes |= bit
            elif state[r][c] == PLAYER:
                player = r * cols + c
    if player < 0:
        raise ValueError("room has no player")
    if boxes == targets:
        return []

    deltas = (-cols, cols, -1, 1)
    shift = (rows * cols).bit_length()
    start = (boxes << shift) | player
    parent: dict[int, tuple[int, int] | None] = {start: None}
    queue = deque([(player, boxes)])
    while queue:
        p, bx = queue.popleft()
        key = (bx << shift) | p
        for action, d in zip(_ACTIONS, deltas):
            n = p + d
            nbit = 1 << n
            if n < 0 or nbit & walls:
                continue
            new_boxes = bx
            if nbit & bx:
                n2bit = 1 << (n + d)
                if n2bit & walls or n2bit & bx:
                    continue
                new_boxes = bx ^ nbit | n2bit
            new_key = (new_boxes << shift) | n
            if new_key in parent:
                continue
            parent[new_key] = (key, action)
            if new_boxes == targets:
                path = []
                node: int | None = new_key
                while parent[node] is not None:
                    node, act = parent[node]
                    path.append(act)
                return path[::-1]
            if len(parent) >= max_states:
                return None
            queue.append((n, new_boxes))
    return None
