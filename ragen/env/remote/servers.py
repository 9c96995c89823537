"""Which env server a new session goes to: the servers of a list in turn, those
that failed lately left out.

One ``ServerChoice`` per server list and process (``choice_for``). It is the one
piece of state remote envs share in a process, and it decides only where an env
runs, never what it shows: every server of a list serves the same envs, and an
episode is a function of its seed.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["ServerChoice", "choice_for"]

DOWN_FOR_S = 30.0  # a server that failed is not picked for this long, unless every server failed


class ServerChoice:
    """Round-robin over ``servers``, skipping those marked down in the last ``down_for_s``."""

    def __init__(self, servers: tuple[str, ...], down_for_s: float = DOWN_FOR_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.servers = servers
        self.down_for_s = down_for_s
        self._clock = clock
        self._next = 0
        self._down: dict[str, float] = {}  # server -> when it failed
        self._lock = threading.Lock()

    def pick(self, avoid: str | None = None) -> str:
        """The next server up (not ``avoid``, when another is up); when every one is down, the one down longest."""
        with self._lock:
            now = self._clock()
            n = len(self.servers)
            order = [self.servers[(self._next + i) % n] for i in range(n)]
            up = [s for s in order if now - self._down.get(s, -float("inf")) >= self.down_for_s]
            preferred = [s for s in up if s != avoid] or up
            chosen = preferred[0] if preferred else min(order, key=lambda s: self._down[s])
            self._next = (self.servers.index(chosen) + 1) % n
            return chosen

    def mark_down(self, server: str) -> None:
        with self._lock:
            self._down[server] = self._clock()

    def down(self) -> list[str]:
        """The servers marked down now."""
        with self._lock:
            now = self._clock()
            return [s for s, t in self._down.items() if now - t < self.down_for_s]


_CHOICES: dict[tuple[str, ...], ServerChoice] = {}
_CHOICES_LOCK = threading.Lock()


def choice_for(servers: tuple[str, ...]) -> ServerChoice:
    """This process's ``ServerChoice`` of ``servers``."""
    with _CHOICES_LOCK:
        choice = _CHOICES.get(servers)
        if choice is None:
            choice = _CHOICES[servers] = ServerChoice(servers)
        return choice
