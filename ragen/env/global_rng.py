"""Python's and numpy's global generators, private to one env while it runs.

Env libraries (TextArena's games, some of reasoning-gym's datasets) draw from
``random`` and ``np.random`` at module level. Envs of one worker share those
generators, so their results would depend on the order in which envs are
stepped (and on threads); and the caller's own draws would move. ``own_rng``
swaps an env's saved state in around its calls and the caller's back after.
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np

from ragen.utils import global_rng_lock

__all__ = ["GlobalRngState", "own_rng"]


class GlobalRngState:
    """One env's states of ``random`` and ``np.random`` (None: not set yet)."""

    __slots__ = ("python", "numpy")

    def __init__(self) -> None:
        self.python: object = None
        self.numpy: object = None


@contextlib.contextmanager
def own_rng(state: GlobalRngState, seed: int | None = None) -> Iterator[None]:
    """The global generators at ``state`` (seeded with ``seed`` when given) while the
    block runs; their states after it kept in ``state``, the caller's restored."""
    with global_rng_lock("own_rng"):  # all_seed's lock too: RAGEN's envs may run beside these
        outer = random.getstate(), np.random.get_state()
        try:
            if seed is not None:
                random.seed(seed)
                np.random.seed(seed % 2**32)
            else:
                if state.python is not None:
                    random.setstate(state.python)
                if state.numpy is not None:
                    np.random.set_state(state.numpy)
            yield
        finally:
            state.python, state.numpy = random.getstate(), np.random.get_state()
            random.setstate(outer[0])
            np.random.set_state(outer[1])
