"""``Streamer``: the manager's path to an engine that batches continuously.

Each request list that arrives goes to ``engine.submit`` at once, with no
coalescing (the engine's own scheduler batches), holding the engine gate
shared until its answers are in. One thread sends answers back: per
connection, every request list that finished since its last frame, in one
frame, so that answers finishing at one decode step travel together. A
request list not answered within ``request_timeout_s`` is answered with an
error, so an engine that loses a request never holds a worker's env past
that; its futures are cancelled, and its requests leave the gate even where
the engine cannot drop them (a future already running), as do those of a
request list its worker cancelled. An engine whose ``submit`` breaks its
contract (``StreamingEngine.checked``), or whose future resolves to something other
than a ``Completion``, fails that request list alone, with an error naming
the engine and what it returned. The requests that stream their ids
(``stream_tokens``) go through ``submit_reporting``, which tells their new ids
(``partials``) before their futures resolve.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from ragen.llm.types import StreamingEngine
from ragen.serving import messages
from ragen.serving.coalescer import Pending
from ragen.serving.gate import EngineGate, GateTimeout
from ragen.serving.inflight import InFlight
from ragen.serving.partials import partial_sink
from ragen.serving.stats import ManagerStats

logger = logging.getLogger(__name__)

# conn -> its answers; sends them (one frame per connection)
SendAnswers = Callable[[dict[Hashable, list[dict[str, Any]]]], None]


@dataclass(eq=False)
class _Entry:
    """A request list sent to the engine, until its answer is on its way (``InFlight`` counts its requests)."""

    pending: Pending
    futures: list[Future] = field(default_factory=list)
    deadline: float | None = None
    answered: bool = False  # its answer is on its way (or its worker's cancel, or its timeout, ended it)
    answer: dict[str, Any] | None = None  # when not made of its futures: the error that ended it


class Streamer:
    """Request lists forwarded to a ``StreamingEngine`` as they arrive, and
    their answers sent back as they finish (see the module docstring)."""

    def __init__(self, engine: StreamingEngine, gate: EngineGate, stats: ManagerStats, reply: SendAnswers,
                 request_timeout_s: float | None) -> None:
        self.engine = engine
        self.gate = gate
        self.stats = stats
        self.reply = reply
        self.request_timeout_s = request_timeout_s
        self._cond = threading.Condition()
        # by entry: its requests in the gate, not done, not given up (counted under _cond)
        self.flight = InFlight(engine, gate, lambda start, end: stats.record_busy((start, end)), self._cond,
                               time.monotonic)
        self._done: list[_Entry] = []
        self._waiting: set[_Entry] = set()  # with a deadline, not answered yet
        self._by_ticket: dict[tuple[Hashable, int], _Entry] = {}  # not answered yet
        self._closed = False
        self._thread = threading.Thread(target=self._reply_loop, name="ragen-llm-streamer", daemon=True)
        self._thread.start()

    def submit(self, p: Pending) -> None:
        """``p``'s requests to the engine now (waits while a weight swap holds the gate, at
        most until the request's deadline)."""
        n = len(p.requests)
        entry = _Entry(p)
        if self.request_timeout_s is not None:
            entry.deadline = time.monotonic() + self.request_timeout_s
        try:
            self.flight.enter(entry, n, None if entry.deadline is None else max(0.0, entry.deadline - time.monotonic()))
        except GateTimeout as exc:
            logger.warning("%d requests (env %s, turn %s) not sent to the engine: %s", n, p.requests[0].env_id,
                           p.requests[0].turn, exc)
            self._fail(entry, {"ticket": p.ticket, "timed_out": True,
                               "error": f"not sent to the {self.engine.label}: {exc}"})
            return
        with self._cond:
            if entry.deadline is not None:
                self._waiting.add(entry)
            self._by_ticket[(p.conn, p.ticket)] = entry
            self._cond.notify_all()  # a new deadline
        self.stats.record_submit(n)
        try:
            futures = self.flight.submit(entry, p.requests, p.sampling, partial_sink([p], self.stats))
        except Exception as exc:  # refused, or the engine broke its contract: their worker hears why, the others go on
            logger.exception("the %s refused %d requests", self.engine.label, n)
            self._fail(entry, messages.error_answer(p.ticket, exc))
            return
        with self._cond:
            entry.futures = futures
            ended = entry.answered  # past its deadline while the engine took it
        if ended:
            for f in _let_go(entry):
                f.cancel()
            return
        for i, f in enumerate(entry.futures):
            f.add_done_callback(lambda _, e=entry, i=i: self._one_done(e, i))

    def _end(self, entry: _Entry) -> None:
        """``entry`` is answered or given up (under ``_cond``): no deadline, no ticket to cancel."""
        entry.answered = True
        self._waiting.discard(entry)
        self._by_ticket.pop((entry.pending.conn, entry.pending.ticket), None)

    def _one_done(self, entry: _Entry, i: int) -> None:
        with self._cond:
            gone = self.flight.release(entry, {i})
            if gone and not self.flight.holds(entry) and not entry.answered:
                self._end(entry)
                self._done.append(entry)
                self._cond.notify_all()
        if gone:
            self.gate.leave(gone)

    def _fail(self, entry: _Entry, answer: dict[str, Any]) -> None:
        """``entry`` answered with ``answer``, all its requests out of the gate."""
        with self._cond:
            gone = self.flight.release(entry)
            if not entry.answered:
                entry.answer = answer
                self._end(entry)
                self._done.append(entry)
                self._cond.notify_all()
        if gone:
            self.gate.leave(gone)

    def _give_up(self, entries: list[_Entry]) -> None:
        """``entries`` (ended, under ``_cond`` before) out of the gate, and their requests
        dropped by the engine where it still can (a running future cannot be cancelled:
        its request leaves the gate all the same, and its answer goes nowhere)."""
        with self._cond:
            gone = sum(self.flight.release(e) for e in entries)
        if gone:
            self.gate.leave(gone)
        for e in entries:
            for f in _let_go(e):
                f.cancel()

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
                for e in expired:
                    self._end(e)
            try:
                self._give_up(expired)
                self._send(done, expired)
            except Exception:  # a bug here must not end the thread: every later answer would wait for ever
                logger.exception("could not answer %d request lists", len(done) + len(expired))
            for e in done:
                _let_go(e)

    def _expired(self) -> list[_Entry]:
        now = time.monotonic()
        return [e for e in self._waiting if e.deadline is not None and e.deadline <= now and not e.answered]

    def _send(self, done: list[_Entry], expired: list[_Entry]) -> None:
        answers: dict[Hashable, list[dict[str, Any]]] = {}
        for e in done:
            answers.setdefault(e.pending.conn, []).append(self._answer(e))
        for e in expired:
            logger.warning("no answer from the engine within agent_proxy.engine_timeout_s=%g s for %d requests "
                           "(env %s, turn %s)", self.request_timeout_s, len(e.pending.requests),
                           e.pending.requests[0].env_id, e.pending.requests[0].turn)
            answers.setdefault(e.pending.conn, []).append({"ticket": e.pending.ticket, "timed_out": True, "error": (
                f"no answer from the engine within agent_proxy.engine_timeout_s={self.request_timeout_s:g} s")})
        if answers:
            self.reply(answers)

    def cancel(self, conn: Hashable, ticket: int) -> None:
        """Its worker stopped waiting for ``ticket``: not answered, its requests out of the
        gate and dropped by the engine."""
        with self._cond:
            entry = self._by_ticket.get((conn, ticket))
            if entry is None:
                return
            self._end(entry)
        self._give_up([entry])

    def take_where(self, keep: Callable[[Hashable], bool]) -> list[Pending]:
        """The request lists in flight of the connections for which ``keep`` is true, ended
        unanswered as a cancel ends them (the caller answers them)."""
        with self._cond:
            taken = [e for e in self._by_ticket.values() if keep(e.pending.conn)]
            for e in taken:
                self._end(e)
        self._give_up(taken)
        return [e.pending for e in taken]

    def close(self) -> None:
        """Stops the reply thread; the requests still in flight leave the gate (nobody reads their answers)."""
        with self._cond:
            self._closed = True
            left = list(self._by_ticket.values())
            for e in left:
                self._end(e)
            self._cond.notify_all()
        self._give_up(left)
        self._thread.join(timeout=5)

    def _answer(self, e: _Entry) -> dict[str, Any]:
        """The answer to one finished request list: its completions, or the error one of them ended with."""
        p = e.pending
        if e.answer is not None:
            return e.answer
        try:
            completions = [f.result() for f in e.futures]  # all done: no wait
        except Exception as exc:  # the engine's error for that request list, whatever its type
            return messages.error_answer(p.ticket, exc)
        return messages.completions_answer(p.ticket, p.transit_in, completions, p.requests, self.engine.label)


def _let_go(e: _Entry) -> list[Future]:
    """Drops an ended entry's futures, and returns them. Each future's done callback
    holds the entry: kept, they would make a cycle that holds its requests and
    completions until a full collection, which a manager that froze its heap
    (``LLMAgentProxy``) runs seldom."""
    futures, e.futures = e.futures, []
    return futures
