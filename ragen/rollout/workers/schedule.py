"""Which groups a parallel worker plays next: a rollout's groups handed out
in chunks as workers ask for them (pull-based load balancing), so a worker
that drew costly envs simply takes fewer.

Chunk sizes follow guided self-scheduling (Polychronopoulos & Kuck, 1987):
each chunk is ``ceil(remaining / (workers * depth))`` groups, so the first
``workers * depth`` chunks give the engine its first requests early and the
last ones are single groups (the tail evens out), or, once a rollout has
measured what a group costs, chunks of at least ``CHUNK_WORK_S`` of env work.
The sizes depend only on how many groups remain, never on which worker asks,
so the number of chunks (each one stream) is known before the rollout
(``chunk_sizes``) and the shared manager is told how many streams to wait
for. A worker's streams past its first ``depth`` merge into those once an
engine call answers them together (``scheduler.Scheduler``).
"""

from __future__ import annotations

import math
import threading
from operator import attrgetter
from typing import Callable, Sequence, TypeVar

from ragen.rollout.types import Trajectory

# The env work a chunk carries at least, once the cost of a group is known: handing
# out a chunk costs a few messages between a worker and the driver, which a chunk
# of cheap groups would not repay; at ten times that cost, what a chunk leaves
# unbalanced is small next to it (BENCHMARKS.md, the overhead preset).
CHUNK_WORK_S = 0.01


def min_chunk_groups(group_s: float | None) -> int:
    """The fewest groups in a chunk for groups costing ``group_s`` seconds of
    env work each (1 while unknown)."""
    if not group_s or group_s <= 0 or not math.isfinite(group_s):
        return 1
    return max(1, math.ceil(CHUNK_WORK_S / group_s))


def group_costs(trajectories: Sequence[Trajectory]) -> dict[int, float]:
    """Env time (resets and steps) of each group, summed over its envs, by group id."""
    costs: dict[int, float] = {}
    for t in trajectories:
        costs[t.group_id] = costs.get(t.group_id, 0.0) + t.reset_s + sum(turn.env_s for turn in t.turns)
    return costs


def group_cost_s(trajectories: Sequence[Trajectory]) -> float | None:
    """Mean env time (resets and steps) of the trajectories' groups; None for none."""
    costs = group_costs(trajectories)
    return sum(costs.values()) / len(costs) if costs else None


T = TypeVar("T")


def groups_of(items: Sequence[T], group_id: Callable[[T], int] = attrgetter("group_id")) -> list[list[T]]:
    """Items (specs, or what holds one) by group, groups in order of first
    appearance, members in order."""
    groups: dict[int, list[T]] = {}
    for item in items:
        groups.setdefault(group_id(item), []).append(item)
    return list(groups.values())


def chunk_sizes(n_groups: int, n_workers: int, depth: int = 1, max_groups: int | None = None,
                min_groups: int = 1) -> list[int]:
    """Groups in each chunk, in the order they are handed out.
    ``max_groups``: no chunk larger (``max_env_num_per_worker``, which wins);
    ``min_groups``: none smaller, but the last (``min_chunk_groups``), up to
    an even share of ``n_workers * depth`` chunks."""
    if n_groups < 0 or n_workers < 1 or depth < 1 or min_groups < 1:
        raise ValueError(f"chunk_sizes: bad arguments n_groups={n_groups}, n_workers={n_workers}, depth={depth}, "
                         f"min_groups={min_groups}")
    sizes, remaining, slots = [], n_groups, n_workers * depth
    min_groups = min(min_groups, -(-n_groups // slots))  # never coarser than one chunk per slot
    while remaining:
        size = min(remaining, max(min_groups, -(-remaining // slots)))
        if max_groups:
            size = min(size, max_groups)
        sizes.append(size)
        remaining -= size
    return sizes


class GroupQueue:
    """One rollout's groups, handed out in chunks (thread-safe: the shared
    manager serves each worker's connection on a thread of its own)."""

    def __init__(self, n_groups: int, n_workers: int, depth: int = 1, max_groups: int | None = None,
                 min_groups: int = 1) -> None:
        self.sizes = chunk_sizes(n_groups, n_workers, depth, max_groups, min_groups)
        self._next_chunk = 0
        self._next_group = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Chunks in all (each is one stream)."""
        return len(self.sizes)

    def take(self) -> list[int]:
        """The next chunk's group indices; empty once every group is handed out."""
        with self._lock:
            if self._next_chunk >= len(self.sizes):
                return []
            size = self.sizes[self._next_chunk]
            self._next_chunk += 1
            start, self._next_group = self._next_group, self._next_group + size
            return list(range(start, start + size))

    def close(self) -> None:
        """Hand out nothing more (the rollout ended or failed)."""
        with self._lock:
            self._next_chunk = len(self.sizes)
