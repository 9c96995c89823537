"""Small helpers shared across ragen.

``all_seed`` exists for RAGEN compatibility: RAGEN's env modules seed the
process-global ``random`` and ``numpy`` generators around room generation and
import it from here. Our own envs never touch a global generator (each owns a
``numpy.random.Generator``), because global seeding is not thread-safe.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

__all__ = ["all_seed"]


@contextmanager
def all_seed(seed: int | None) -> Iterator[None]:
    """Seed Python's ``random`` and numpy's global RNG; restore both on exit.

    The previous states come back even when the body raises, so code after the
    block sees the generators exactly as it left them. ``seed=None`` reseeds from
    fresh entropy (as ``random.seed(None)`` does). numpy's legacy seeding takes
    32-bit seeds only, so larger ints are reduced modulo 2**32.
    """
    random_state = random.getstate()
    np_state = np.random.get_state()
    try:
        random.seed(seed)
        np.random.seed(None if seed is None else int(seed) % 2**32)
        yield
    finally:
        random.setstate(random_state)
        np.random.set_state(np_state)
