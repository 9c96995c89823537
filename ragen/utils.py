"""Small helpers shared across ragen.

``deal`` hands items out in turn, as cards are dealt: it is how whole env
groups are spread over shards and micro-batches, and envs over tags in a
soak's validation layout, so that tags laid out in blocks end up mixed.

``common_prefix_length`` counts the leading items that sequences share: a
group's common prompt (the trainer's update, the hf engine's prefill) and a
turn's prompt messages kept from the previous turn (dumps, the viewer).

``is_loopback_host`` says whether a host name or address is this machine's
loopback: a remote env's URL and an env server's address (a key is needed
beyond it), and a cluster's driver address.

``closed_on_failure`` closes what a block opened when the block fails (an
interrupt too) and lets the failure go on; on success the caller keeps it.

``all_seed`` exists for RAGEN compatibility: RAGEN's env modules seed the
process-global ``random`` and ``numpy`` generators around room generation and
import it from here. Our own envs never touch a global generator (each owns a
``numpy.random.Generator``). Global seeding is not thread-safe by itself, so
``all_seed`` holds one process-wide lock for the whole block: two threads (the
``threading`` backend, or a ``parallel_friendly`` tag's thread pool) never
interleave their draws, and a RAGEN env gives the same results on threads as
alone.
"""

from __future__ import annotations

import ipaddress
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import numpy as np

__all__ = ["all_seed", "closed_on_failure", "common_prefix_length", "deal", "global_rng_lock", "GLOBAL_RNG_WAIT_S"]

T = TypeVar("T")

# Bound on the wait for another thread's ``all_seed`` block: a block lasts as
# long as one env's generation (milliseconds to a second), so only an env stuck
# inside its block (e.g. one abandoned after ``env_timeout_s``) makes anyone
# wait this long.
GLOBAL_RNG_WAIT_S = 120.0
# the global generators are one per process: one block at a time in them, all_seed's and own_rng's
# (ragen.env.global_rng); re-entrant: an env may nest the blocks
_GLOBAL_RNG_LOCK = threading.RLock()


@contextmanager
def global_rng_lock(who: str) -> Iterator[None]:
    """The process's one lock on Python's and numpy's global generators, waited for at most
    ``GLOBAL_RNG_WAIT_S``; ``who`` names the block in the ``TimeoutError``."""
    if not _GLOBAL_RNG_LOCK.acquire(timeout=GLOBAL_RNG_WAIT_S):
        # TimeoutError, not RuntimeError: RAGEN's envs catch RuntimeError around
        # generation and retry with another seed, which would wait again.
        raise TimeoutError(
            f"{who}: waited {GLOBAL_RNG_WAIT_S} s for the global RNG, which another thread holds; "
            "an env is stuck inside its block (set agent_proxy.env_timeout_s to find it)"
        )
    try:
        yield
    finally:
        _GLOBAL_RNG_LOCK.release()


@contextmanager
def closed_on_failure(*closes: Callable[[], object] | None) -> Iterator[None]:
    """Calls ``closes`` in order (a None skipped: nothing was opened) when the block raises
    anything, an interrupt included, then re-raises it; a ``close`` that raises ends it, its
    error raised with the block's as its context, as an ``except`` that closes and re-raises."""
    try:
        yield
    except BaseException:
        for close in closes:
            if close is not None:
                close()
        raise


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (``localhost`` or an IP address, an IPv6 zone included) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def deal(items: Sequence[T], n: int) -> list[list[T]]:
    """``items`` dealt out in turn into ``n`` hands: item ``k`` goes to hand
    ``k % n``, and each hand keeps the items' order (hands past the last item
    are empty)."""
    return [list(items[i::n]) for i in range(n)]


def common_prefix_length(seqs: Sequence[Sequence]) -> int:
    """How many leading items every sequence of ``seqs`` has in common (0 for none).

    Found by halving a length whose slices are compared, so the items are compared
    in C, not one by one in Python: token ids run to thousands an episode."""
    if not seqs:
        return 0
    if len({type(s) for s in seqs}) > 1:  # a list's slice never equals a tuple's
        seqs = [list(s) for s in seqs]
    first, rest = seqs[0], seqs[1:]

    def shared(n: int) -> bool:
        return all(s[:n] == first[:n] for s in rest)

    low, high = 0, min(len(s) for s in seqs)
    if shared(high):
        return high
    high -= 1  # the longest shared length is below the shortest sequence's
    while low < high:
        mid = (low + high + 1) // 2
        if shared(mid):
            low = mid
        else:
            high = mid - 1
    return low


@contextmanager
def all_seed(seed: int | None) -> Iterator[None]:
    """Seed Python's ``random`` and numpy's global RNG; restore both on exit.

    The previous states come back even when the body raises, so code after the
    block sees the generators exactly as it left them. ``seed=None`` reseeds from
    fresh entropy (as ``random.seed(None)`` does). numpy's legacy seeding takes
    32-bit seeds only, so larger ints are reduced modulo 2**32. The block runs
    under a process-wide lock (see the module docstring); waiting longer than
    ``GLOBAL_RNG_WAIT_S`` for it raises ``TimeoutError``.
    """
    with global_rng_lock("all_seed"):
        random_state = random.getstate()
        np_state = np.random.get_state()
        try:
            random.seed(seed)
            np.random.seed(None if seed is None else int(seed) % 2**32)
            yield
        finally:
            random.setstate(random_state)
            np.random.set_state(np_state)
