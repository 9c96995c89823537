"""``EngineGate``: the engine lock, for engines that answer one call at a time and engines that stream.

Held as a lock (``with gate:``) around each batch engine call and by the
trainer while it swaps weights. A streaming engine's requests hold it
*shared* from their submit to their completion (``enter(n)`` / ``leave(n)``):
many at once, never alongside a holder of the lock. A thread that asks for
the lock stops new requests from entering and waits for those in flight to
finish, so weights never change under a request, and a stream of requests
that never pauses cannot starve the trainer.

A request waits to enter at most ``timeout_s`` (or its caller's
``timeout``), and the lock waits for requests in flight at most as long;
past that, ``GateTimeout`` says what held the gate (the lock and for how
long, the threads asking for it, the requests in flight). The lock waits for
another holder of it without a bound: that holder's engine call or weight
swap ends by itself, and an engine call that hangs is the engine's to bound.
Every wait that goes on is logged every ``report_every_s``, with the same
account.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ragen.errors import RagenError

logger = logging.getLogger(__name__)


class GateTimeout(RagenError, TimeoutError):
    """A wait for the engine gate ran past its bound; the message says what held it."""


class EngineGate:
    """A lock that requests in flight hold shared; the lock waits for them, and new ones wait for the lock.

    ``timeout_s``: the longest wait of ``acquire`` (and ``with gate:``) for
    requests in flight, and of ``enter`` without a ``timeout`` of its own; None
    waits as long as they take (a rollout's gate: twice
    ``agent_proxy.engine_timeout_s``, ``for_requests``)."""

    report_every_s = 60.0  # a wait this long is logged, with what it waits for, and again each time as long

    def __init__(self, timeout_s: float | None = None) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"EngineGate timeout_s must be > 0 seconds or None, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._held = False
        self._held_since = 0.0
        self._waiting = 0  # threads waiting for the lock: new requests wait behind them
        self._in_flight = 0
        self._busy_since = 0.0  # since when requests have been in flight without a pause

    @classmethod
    def for_requests(cls, request_timeout_s: float | None) -> "EngineGate":
        """The gate of an engine whose streamed requests each leave it within
        ``request_timeout_s`` of their arrival (answered, or given up): its bound is
        twice that, room for a request that waited to enter and for the thread that
        gives it up; None: no bound."""
        return cls(None if request_timeout_s is None else 2 * request_timeout_s)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._in_flight

    def acquire(self, timeout: float | None = None) -> bool:
        """Takes the lock once no other thread holds it and no request is in
        flight; ``GateTimeout`` once it waited ``timeout`` (default ``timeout_s``)
        for requests in flight. No new request enters while it waits."""
        with self._cond:
            self._waiting += 1
            try:
                # the time another holder keeps the lock does not count (see the module docstring)
                self._wait(lambda: not self._held and self._in_flight == 0, timeout, "the engine lock", asking=1,
                           counts=lambda: not self._held)
            finally:
                self._waiting -= 1
                if not self._waiting:
                    self._cond.notify_all()  # requests held out by this wait may enter
            self._held = True
            self._held_since = time.monotonic()
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

    def enter(self, n: int = 1, timeout: float | None = None) -> None:
        """``n`` requests go in flight: waits while the lock is held or asked
        for; ``GateTimeout`` after ``timeout`` (default ``timeout_s``), and then
        they are not in flight."""
        with self._cond:
            self._wait(lambda: not self._held and self._waiting == 0, timeout,
                       f"{n} requests to enter the engine lock")
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += n

    def leave(self, n: int = 1) -> None:
        """``n`` requests in flight ended."""
        with self._cond:
            if n > self._in_flight:
                raise RuntimeError(f"{n} requests leave an EngineGate that has {self._in_flight} in flight")
            self._in_flight -= n
            if self._in_flight == 0:
                self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool], timeout: float | None, what: str, asking: int = 0,
              counts: Callable[[], bool] = lambda: True) -> None:
        """Waits (holding ``_cond``) until ``ready()``: ``GateTimeout`` once the time
        waited while ``counts()`` passes the bound, a warning each ``report_every_s``,
        both saying what holds the gate (``asking``: the waiting threads that are this one)."""
        bound = self.timeout_s if timeout is None else timeout
        start = time.monotonic()
        spent = 0.0  # waited while it counts toward the bound
        report_at = start + self.report_every_s
        while not ready():
            counting = bound is not None and counts()
            now = time.monotonic()
            if counting and spent >= bound:
                waited = f"{spent:.3g} s" if now - start - spent < 1e-3 else \
                    f"{spent:.3g} s for requests in flight ({now - start:.3g} s in all)"
                raise GateTimeout(f"waited {waited} for {what} (the bound: {bound:g} s): {self._holders(now, asking)}")
            if now >= report_at:
                logger.warning("waited %.3g s so far for %s: %s", now - start, what, self._holders(now, asking))
                report_at = now + self.report_every_s
            until = min(report_at, now + bound - spent) if counting else report_at
            self._cond.wait(until - now)  # every change of the state waited on notifies
            if counting:
                spent += time.monotonic() - now

    def _holders(self, now: float, asking: int) -> str:
        """What holds the gate (under ``_cond``), besides ``asking`` threads waiting for the lock."""
        parts = []
        if self._held:
            parts.append(f"the lock held for {now - self._held_since:.3g} s (by an engine call or a weight swap)")
        if self._waiting > asking:
            parts.append(f"{self._waiting - asking} {'other ' if asking else ''}threads wait for the lock")
        if self._in_flight:
            parts.append(f"{self._in_flight} requests in flight, the gate busy without a pause for "
                         f"{now - self._busy_since:.3g} s")
        return "; ".join(parts) or "nothing holds it now"
