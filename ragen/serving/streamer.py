"""``Streamer``: the manager's path to an engine that batches continuously.

Each request list that arrives goes to ``engine.submit`` at once, with no
coalescing (the engine's own scheduler batches), holding the engine gate
shared until its answers are in. One thread sends answers back: per
connection, every request list that finished since its last frame, in one
frame, so that answers finishing at one decode step travel together. A
request list not answered within ``request_timeout_s`` is answered with an
error (its futures cancelled), so an engine that loses a request never holds
a worker's env past that.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from ragen.llm.types import Engine
from ragen.serving import wire
from ragen.serving.coalescer import Pending
from ragen.serving.gate import EngineGate
from ragen.serving.stats import ManagerStats

logger = logging.getLogger(__name__)

# conn -> its answers; sends them (one frame per connection)
Reply = Callable[[dict[Hashable, list[dict[str, Any]]]], None]


@dataclass(eq=False)
class _InFlight:
    pending: Pending
    futures: list[Future] = field(default_factory=list)
    deadline: float | None = None
    left: int = 0  # futures not done yet
    answered: bool = False  # its answer (or its timeout's error) went out


class Streamer:
    """Request lists forwarded to a ``StreamingEngine`` as they arrive, and
    their answers sent back as they finish (see the module docstring)."""

    def __init__(self, engine: Engine, gate: EngineGate, stats: ManagerStats, reply: Reply,
                 request_timeout_s: float | None) -> None:
        self.engine = engine
        self.gate = gate
        self.stats = stats
        self.reply = reply
        self.request_timeout_s = request_timeout_s
        self._cond = threading.Condition()
        self._done: list[_InFlight] = []
        self._waiting: set[_InFlight] = set()  # with a deadline, not answered yet
        self._by_ticket: dict[tuple[Hashable, int], _InFlight] = {}  # not answered yet
        self._in_flight = 0  # requests
        self._busy_since = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._reply_loop, name="ragen-llm-streamer", daemon=True)
        self._thread.start()

    def submit(self, p: Pending) -> None:
        """``p``'s requests to the engine now (waits while the gate is held: a weight swap)."""
        entry = _InFlight(p, left=len(p.requests))
        if self.request_timeout_s is not None:
            entry.deadline = time.monotonic() + self.request_timeout_s
        self.gate.enter(len(p.requests))
        with self._cond:
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += len(p.requests)
            if entry.deadline is not None:
                self._waiting.add(entry)
            self._by_ticket[(p.conn, p.ticket)] = entry
            self._cond.notify_all()  # a new deadline
        self.stats.record_submit(len(p.requests))
        try:
            entry.futures = self.engine.submit(p.requests, p.sampling)
        except Exception as exc:  # the engine refused them: their worker hears why, the others go on
            logger.exception("the engine refused %d requests", len(p.requests))
            failed: Future = Future()
            failed.set_exception(exc)
            entry.futures = [failed] * len(p.requests)
            for _ in p.requests:
                self._one_done(entry)
            return
        for f in entry.futures:
            f.add_done_callback(lambda _, e=entry: self._one_done(e))

    def _one_done(self, entry: _InFlight) -> None:
        self.gate.leave()
        with self._cond:
            self._in_flight -= 1
            if self._in_flight == 0:
                now = time.monotonic()
                self.stats.record_busy((self._busy_since, now))
            entry.left -= 1
            if entry.left == 0:
                self._waiting.discard(entry)
                self._by_ticket.pop((entry.pending.conn, entry.pending.ticket), None)
                if not entry.answered:
                    self._done.append(entry)
                    self._cond.notify_all()

    def _reply_loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._done or self._expired()):
                    deadlines = [e.deadline for e in self._waiting if e.deadline is not None]
                    # None when no request has a deadline: a request, close() or a
                    # deadline's change notifies
                    self._cond.wait(None if not deadlines else max(0.0, min(deadlines) - time.monotonic()))
                if self._closed:
                    return
                done, self._done = self._done, []
                expired = self._expired()
                for e in done + expired:
                    e.answered = True
                    self._waiting.discard(e)
                    self._by_ticket.pop((e.pending.conn, e.pending.ticket), None)
            for e in expired:
                _give_up(e)
            try:
                self._send(done, expired)
            except Exception:  # a bug here must not end the thread: every later answer would wait for ever
                logger.exception("could not answer %d request lists", len(done) + len(expired))
            for e in done:
                _let_go(e)

    def _expired(self) -> list[_InFlight]:
        now = time.monotonic()
        return [e for e in self._waiting if e.deadline is not None and e.deadline <= now and not e.answered]

    def _send(self, done: list[_InFlight], expired: list[_InFlight]) -> None:
        answers: dict[Hashable, list[dict[str, Any]]] = {}
        for e in done:
            answers.setdefault(e.pending.conn, []).append(_answer(e))
        for e in expired:
            logger.warning("no answer from the engine within agent_proxy.engine_timeout_s=%g s for %d requests "
                           "(env %s, turn %s)", self.request_timeout_s, len(e.pending.requests),
                           e.pending.requests[0].env_id, e.pending.requests[0].turn)
            answers.setdefault(e.pending.conn, []).append({"ticket": e.pending.ticket, "timed_out": True, "error": (
                f"no answer from the engine within agent_proxy.engine_timeout_s={self.request_timeout_s:g} s")})
        if answers:
            self.reply(answers)

    def cancel(self, conn: Hashable, ticket: int) -> None:
        """Its worker stopped waiting for ``ticket``: not answered, its requests dropped by the engine."""
        with self._cond:
            entry = self._by_ticket.pop((conn, ticket), None)
            if entry is None:
                return
            entry.answered = True
            self._waiting.discard(entry)
        _give_up(entry)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)


def _let_go(e: _InFlight) -> list[Future]:
    """Drop an answered entry's futures, and return them. Each future's done callback
    holds the entry: kept, they would make a cycle that holds its requests and
    completions until a full collection, which a manager that froze its heap
    (``LLMAgentProxy``) runs seldom."""
    futures, e.futures = e.futures, []
    return futures


def _give_up(e: _InFlight) -> None:
    """Nobody waits for ``e`` now: what the engine has not finished leaves its batch."""
    for f in _let_go(e):
        f.cancel()


def _answer(e: _InFlight) -> dict[str, Any]:
    """The answer to one finished request list: its completions, or the error one of them ended with."""
    p = e.pending
    try:
        completions = [f.result() for f in e.futures]  # all done: no wait
    except Exception as exc:
        return wire.error_answer(p.ticket, exc)
    try:
        return {"ticket": p.ticket, "transit_in": p.transit_in,
                "completions": [wire.completion_for_wire(c, r) for c, r in zip(completions, p.requests)]}
    except Exception as exc:  # that request list only
        logger.error("malformed completion from the engine: %s", exc)
        return {"ticket": p.ticket, "error": f"{type(exc).__name__}: {exc}"}
