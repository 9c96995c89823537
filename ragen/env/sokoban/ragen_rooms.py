"""RAGEN's Sokoban rooms, draw for draw: the room RAGEN's ``SokobanEnv.reset(seed)`` makes.

RAGEN generates a room with gym-sokoban's algorithm under ``all_seed(seed)``
(Python's ``random`` and numpy's legacy ``np.random`` both seeded with the
seed). This module makes the same random draws, in the same order, from its own
``random.Random(seed)`` and ``np.random.RandomState(seed)`` (the generators
those global functions use), and runs the same reverse-play search, so the same
seed gives the same room. Nothing global is touched (the numpy generator is
one per thread, re-seeded for each room).

Concepts:

- **Topology**: a random walk of ``int(1.7 * (rows + cols))`` steps from a
  random start, turning with probability 0.35; at each step one of five small
  masks is stamped as floor around the walker. The border is wall.
- **Placement**: the player on a random floor cell, then each target on a
  random remaining floor cell (numpy draws over the free cells in row-major
  order). Every box starts on its target.
- **Reverse play** (``_reverse_search``): a depth-first search over moves and
  pulls from the solved state, actions in the order up, down, left, right,
  depth bounded by ``search_depth``. A state is the grid (player, boxes, and
  whether each box has been pulled yet); a state seen once is never searched
  again, even when it is met later by a shorter path, so the order of the
  search decides the result. Each new state scores ``box swaps x box
  displacement`` (0 while a target is covered; swaps: how often, along the
  path, a pull moved another box than the pull before; displacement: the
  boxes' Manhattan distances from their targets), and the first state with the
  highest score is the puzzle. The search stops after 300,000 states.
- **Tries and retries**: up to 4 topologies per seed until one has a positive
  score; a seed whose room has too few free cells, or whose 4 tries all score 0,
  fails, and the env retries with ``RandomState(seed % 2**32).randint(2**32)``
  as the next seed (32 seeds at most).
- **Player walk**: after the search the player takes up to 3 random steps onto
  free cells it has not visited (with probability 0.8 if the displacement is 1,
  else 0.5; each further step with probability 0.5).

The search visits states in RAGEN's order but holds a state as integers (the
player's cell and two bitmasks of boxes, pulled and not yet pulled), keeps the
displacement up to date per pull, and makes no call for a move into a wall or
onto an explored state, where RAGEN copies and hashes numpy arrays for each:
14-20x faster at RAGEN's settings (``benchmarks/sokoban_generation.py``).
``generate_ragen_room`` is a pure function of (room size, boxes, search depth,
seed), memoised like ``generator.generate_room``.
"""

from __future__ import annotations

import random
import sys
import threading
from functools import lru_cache

import numpy as np

from ...errors import RagenError
from .generator import _STAMPS, BOX, FLOOR, PLAYER, TARGET, WALL, GeneratedRoom, _bits, _walk_tables

__all__ = ["generate_ragen_room", "RoomGenerationFailed", "MAX_EXPLORED_STATES", "MAX_SEED_RETRIES"]

# RAGEN's bounds: the reverse search stops after this many states; a reset
# tries this many seeds (the given one, then derived ones) before giving up.
MAX_EXPLORED_STATES = 300_000
MAX_SEED_RETRIES = 32
_TRIES = 4
_P_CHANGE_DIRECTION = 0.35
# RAGEN's walk directions (down, right, up, left) and its five stamp masks, by
# index into generator's walk tables, which list them in RAGEN's order
_DIRECTION_IDS = (0, 1, 2, 3)
_N_MASKS = len(_STAMPS)
_MASK_IDS = tuple(range(_N_MASKS))
# Reverse-play and player-walk actions: up, down, left, right as (row, col) changes.
_CHANGES = ((-1, 0), (1, 0), (0, -1), (0, 1))


# One legacy numpy generator per thread, re-seeded per room: seeding costs about a
# microsecond, building a RandomState about 150.
_numpy_rngs = threading.local()


def _numpy_rng(seed: int) -> np.random.RandomState:
    rng = getattr(_numpy_rngs, "rng", None)
    if rng is None:
        rng = _numpy_rngs.rng = np.random.RandomState()
    rng.seed(seed)
    return rng


class RoomGenerationFailed(RagenError):
    """A seed that yields no room: too few free cells, or no try scored above 0."""


def _topology(rows: int, cols: int, rng: random.Random) -> int:
    """The random-walk floor plan as a cell bitmask (RAGEN's draws in RAGEN's order).

    RAGEN's directions and stamp masks are in the order of ``generator``'s walk
    tables, which hold each clamped step and each stamp clipped to the interior
    (RAGEN stamps onto the border and then walls it again). RAGEN picks with
    ``sample(seq, 1)[0]``; ``choice(seq)`` makes the same single
    ``_randbelow(len(seq))`` draw and picks the same item, for less overhead.
    """
    moves, stamps = _walk_tables(rows, cols)
    d = rng.choice(_DIRECTION_IDS)
    cell = rng.randint(1, rows - 1) * cols + rng.randint(1, cols - 1)
    floor = 0
    rnd, choice = rng.random, rng.choice
    for _ in range(int(1.7 * (rows + cols))):
        if rnd() < _P_CHANGE_DIRECTION:
            d = choice(_DIRECTION_IDS)
        cell = moves[cell * 4 + d]
        floor |= stamps[cell * _N_MASKS + choice(_MASK_IDS)]
    return floor


def _place(floor: int, num_boxes: int, nrng: np.random.RandomState) -> tuple[int, list[int]]:
    """The player's cell and the targets' cells (row-major indices), drawn as RAGEN draws them."""
    free = _bits(floor)  # row-major, as numpy's where() lists them
    if len(free) <= num_boxes + 1:
        raise RoomGenerationFailed(f"not enough free cells ({len(free)}) for the player and {num_boxes} boxes")
    player = free.pop(nrng.randint(len(free)))
    targets = []
    for _ in range(num_boxes):
        targets.append(free.pop(nrng.randint(len(free))))
    return player, targets


def _reverse_search(
    floor: int, targets: list[int], player: int, rows: int, cols: int, search_depth: int
) -> tuple[int, int, int]:
    """RAGEN's reverse-play search; (player cell, box mask, box displacement) of the best state.

    Boxes are numbered by their target in row-major order (RAGEN's box mapping);
    ``loc[k]`` is box ``k``'s cell. The explored set holds (player, pulled boxes,
    unpulled boxes) as one int: the same states RAGEN tells apart by the grid's bytes.
    """
    n = rows * cols
    shift_pulled = n.bit_length()
    shift_unpulled = shift_pulled + n
    target_mask = 0
    for t in sorted(targets):
        target_mask |= 1 << t
    order = sorted(targets)  # RAGEN's box mapping iterates targets row-major
    target_rc = [divmod(t, cols) for t in order]
    loc = list(order)
    deltas = [dr * cols + dc for dr, dc in _CHANGES]
    explored: set[int] = set()
    best = [-1, player, target_mask, 0]  # score, player, boxes, displacement

    def dfs(p: int, pulled: int, unpulled: int, disp: int, swaps: int, last: int, ttl: int, key: int) -> bool:
        """Search from a new state (``key``) that RAGEN's search would enter with ``ttl``
        left; False once the state budget is spent, when RAGEN's search stops
        changing anything. RAGEN enters a state, then returns at once if its ttl is
        spent or the state explored: those calls are skipped here, same outcome."""
        boxes = pulled | unpulled
        # a state scores only when every target is uncovered (RAGEN counts empty targets)
        score = 0 if (boxes | 1 << p) & target_mask else swaps * disp
        if score > best[0]:
            best[0], best[1], best[2], best[3] = score, p, boxes, disp
        explored.add(key)
        if len(explored) >= MAX_EXPLORED_STATES:  # every later call of RAGEN's returns at once
            return False
        if ttl <= 1:  # every child would have no ttl left
            return True
        child_ttl = ttl - 1
        for d in deltas:
            q = p + d
            if not floor >> q & 1 or boxes >> q & 1:
                continue  # RAGEN's move into a wall or box leaves the state as it is: already explored
            b = p - d
            if boxes >> b & 1:  # the box behind the player comes along onto p
                new_pulled = (pulled & ~(1 << b)) | 1 << p
                new_unpulled = unpulled & ~(1 << b)
                child = q | new_pulled << shift_pulled | new_unpulled << shift_unpulled
                if child in explored:
                    continue
                k = loc.index(b)
                tr, tc = target_rc[k]
                br, bc = divmod(b, cols)
                pr, pc = divmod(p, cols)
                moved = disp - abs(br - tr) - abs(bc - tc) + abs(pr - tr) + abs(pc - tc)
                loc[k] = p
                going = dfs(q, new_pulled, new_unpulled, moved, swaps + (k != last), k, child_ttl, child)
                loc[k] = b
            else:
                child = q | pulled << shift_pulled | unpulled << shift_unpulled
                if child in explored:
                    continue
                going = dfs(q, pulled, unpulled, disp, swaps, last, child_ttl, child)
            if not going:
                return False
        return True

    # one frame per search level, as in RAGEN; a deeper search than the interpreter's
    # limit allows raises it for the search only
    limit = sys.getrecursionlimit()
    root = (player, 0, target_mask, 0, 0, -1, search_depth - 1, player | target_mask << shift_unpulled)
    if search_depth <= 1:  # RAGEN's search explores nothing and its reset fails
        pass
    elif search_depth + 100 <= limit:
        dfs(*root)
    else:
        sys.setrecursionlimit(search_depth + 100)
        try:
            dfs(*root)
        finally:
            sys.setrecursionlimit(limit)
    if best[0] < 0:  # search_depth 1: RAGEN's search explores nothing and its reset fails
        raise ValueError(f"search_depth must be at least 2, got {search_depth}")
    return best[1], best[2], best[3]


def _walk_player(state: list[list[int]], fixed: list[list[int]], displacement: int, rng: random.Random) -> None:
    """RAGEN's random player walk after the search (up to 3 steps, in place)."""
    if rng.random() > (0.8 if displacement == 1 else 0.5):
        return
    (r, c), = [(r, c) for r, row in enumerate(state) for c, v in enumerate(row) if v == PLAYER]
    visited = [(r, c)]
    steps = 0
    while steps < 3:
        options = [(r + dr, c + dc) for dr, dc in _CHANGES
                   if state[r + dr][c + dc] in (FLOOR, TARGET) and (r + dr, c + dc) not in visited]
        if not options:
            break
        nr, nc = rng.choice(options)
        state[r][c] = fixed[r][c]
        state[nr][nc] = PLAYER
        r, c = nr, nc
        visited.append((r, c))
        steps += 1
        if steps >= 3 or rng.random() > 0.5:
            break


def _generate_once(rows: int, cols: int, num_boxes: int, search_depth: int, seed: int):
    rng = random.Random(seed)
    nrng = _numpy_rng(seed)
    displacement = 0
    for _ in range(_TRIES):
        floor = _topology(rows, cols, rng)
        player, targets = _place(floor, num_boxes, nrng)
        best_player, boxes, displacement = _reverse_search(floor, targets, player, rows, cols, search_depth)
        if displacement > 0:
            break
    if displacement == 0:
        raise RoomGenerationFailed("no try moved a box off its target")
    fixed = [[WALL] * cols for _ in range(rows)]
    for i in _bits(floor):
        fixed[i // cols][i % cols] = FLOOR
    for t in targets:
        fixed[t // cols][t % cols] = TARGET
    state = [row[:] for row in fixed]
    for i in range(rows * cols):
        if boxes >> i & 1:
            state[i // cols][i % cols] = BOX  # RAGEN writes every box as 'box', pulled or not
    state[best_player // cols][best_player % cols] = PLAYER
    _walk_player(state, fixed, displacement, rng)
    return fixed, state, displacement


@lru_cache(maxsize=2048)
def generate_ragen_room(rows: int, cols: int, num_boxes: int, search_depth: int, seed: int) -> GeneratedRoom:
    """RAGEN's room for ``seed`` (memoised, immutable), retries included.

    ``GeneratedRoom.seed`` is the seed that made the room (the given one or a
    retry); ``min_pushes`` is 0: RAGEN's search does not measure it (the
    displacement score is not a push count). ``RuntimeError`` when 32 seeds fail,
    as RAGEN's reset does.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"RAGEN's rooms take a seed in [0, 2**32) (numpy's legacy seeding), got {seed!r}")
    current = seed
    for _ in range(MAX_SEED_RETRIES):
        try:
            fixed, state, _ = _generate_once(rows, cols, num_boxes, search_depth, current)
        except RoomGenerationFailed:
            current = int(_numpy_rng(current % 2**32).randint(2**32))
            continue
        return GeneratedRoom(
            room_fixed=tuple(map(tuple, fixed)),
            room_state=tuple(map(tuple, state)),
            min_pushes=0,
            seed=str(current),
        )
    raise RuntimeError(
        f"Sokoban room generation failed after {MAX_SEED_RETRIES} retries "
        f"(seed={seed}, dim={(rows, cols)}, num_boxes={num_boxes})"
    )

