"""``EngineGate``: the engine lock, for engines that answer one call at a time and engines that stream.

Held as a lock (``with gate:``) around each batch engine call and by the
trainer while it swaps weights. A streaming engine's requests hold it
*shared* from their submit to their completion (``enter(n)`` / ``leave(n)``):
many at once, never alongside a holder of the lock. A thread that asks for
the lock stops new requests from entering and waits for those in flight to
finish, so weights never change under a request, and a stream of requests
that never pauses cannot starve the trainer.
"""

from __future__ import annotations

import threading
from typing import Any


class EngineGate:
    """A lock that requests in flight hold shared; the lock waits for them, and new ones wait for the lock."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._waiting = 0  # threads waiting for the lock: new requests wait behind them
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._in_flight

    def acquire(self) -> bool:
        with self._cond:
            self._waiting += 1
            try:
                # No bound: the lock's holder releases it when its call or weight swap is done,
                # and every request in flight ends (its engine resolves each future it hands out,
                # with an answer or an error, and a request the engine never answers is bounded
                # by the engine's own timeout).
                self._cond.wait_for(lambda: not self._held and self._in_flight == 0)
            finally:
                self._waiting -= 1
            self._held = True
        return True

    def release(self) -> None:
        with self._cond:
            if not self._held:
                raise RuntimeError("release of an EngineGate that is not held")
            self._held = False
            self._cond.notify_all()

    def locked(self) -> bool:
        with self._cond:
            return self._held

    def __enter__(self) -> "EngineGate":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def enter(self, n: int = 1) -> None:
        """``n`` requests go in flight: waits while the lock is held or asked for
        (no bound, for the reason in ``acquire``: the holder's work ends)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._held and self._waiting == 0)
            self._in_flight += n

    def leave(self, n: int = 1) -> None:
        """``n`` requests in flight ended."""
        with self._cond:
            self._in_flight -= n
            if self._in_flight == 0:
                self._cond.notify_all()
