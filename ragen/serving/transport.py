"""How requests reach an engine, by ticket: the ``Transport`` protocol and the in-process transports.

A ``Transport`` carries request lists to an engine and answers them by
ticket; ``client.LLMClient`` turns that into streams and futures for the
scheduler. ``DirectClient`` calls an engine in the caller's thread (the
sequential rollout: one engine call per turn over all active envs, RAGEN's
loop); ``StreamingDirectClient`` hands each request to an engine that batches
continuously and answers tickets as they finish (``direct_client`` picks the
one an engine needs). A worker process reaches the driver's engine through
``shared_client.SharedLLMClient``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from typing import Protocol

from ragen.llm.types import Completion, Engine, EngineError, EngineUnavailable, GenerationRequest, SamplingParams
from ragen.serving.gate import EngineGate
from ragen.serving.inflight import InFlight


class Transport(Protocol):
    """Request lists submitted for a ticket, answers waited for by ticket, and the count of
    streams (micro-batches with work left) its user has open, for a coalescer to wait for.
    ``streams``: its engine answers each request as soon as it is done (so the scheduler
    runs env-level turns)."""

    streams: bool

    def submit(self, requests: list[GenerationRequest], sampling: SamplingParams, hold: bool = False) -> int:
        """A ticket for the requests' answers; ``wire.MessageTooLarge``, with
        nothing sent, when a client with a message limit cannot carry them.
        ``hold``: the message may wait (briefly) for others to share its
        frame; ``flush``, ``ready`` and ``wait_any`` send what waits."""

    def wait_any(self, timeout: float | None = None) -> tuple[int, list[Completion]] | None:
        """The next finished ticket and its completions; None when ``timeout``
        seconds passed first (None: no limit). ``EngineError`` naming
        the ticket when the engine failed on it."""

    def abandon(self, ticket: int) -> None:
        """Stop waiting for ``ticket`` (its answer, if it comes, is dropped)."""

    def flush(self) -> None:
        """Send what ``hold`` kept back."""

    def open_streams(self, n: int, announced: bool = True) -> None: ...

    def close_stream(self, hold: bool = False) -> None: ...

    def ready(self) -> bool:
        """Whether an answer has arrived, so that ``wait_any`` will not block."""

    def reset(self) -> None:
        """Forget requests in flight (after a failure)."""


class _InProcess:
    """A client in the engine's own process: nothing to send, no streams for a coalescer to count;
    the engine's calls (request lists), their sizes and its busy time counted."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._next = 0  # the last ticket
        self.engine_time_s = 0.0
        self.engine_calls = 0
        self.batch_sizes: list[int] = []

    def flush(self) -> None:
        pass

    def open_streams(self, n: int, announced: bool = True) -> None:
        pass

    def close_stream(self, hold: bool = False) -> None:
        pass


class DirectClient(_InProcess):
    """An engine called in the caller's thread; tickets answered in order."""

    streams = False

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._queue: deque[tuple[int, list[GenerationRequest], SamplingParams]] = deque()

    def submit(self, requests: list[GenerationRequest], sampling: SamplingParams, hold: bool = False) -> int:
        self._next += 1
        self._queue.append((self._next, requests, sampling))
        return self._next

    def wait_any(self, timeout: float | None = None) -> tuple[int, list[Completion]]:
        # ``timeout`` is not applied: the engine runs in this thread, and its call ends when the
        # engine's does (each engine bounds its own calls: its server's timeout, or a local model's steps)
        ticket, requests, sampling = self._queue.popleft()
        t0 = time.perf_counter()
        completions = self.engine.generate(requests, sampling)
        self.engine_time_s += time.perf_counter() - t0
        self.engine_calls += 1
        self.batch_sizes.append(len(requests))
        return ticket, completions

    def abandon(self, ticket: int) -> None:
        self._queue = deque(q for q in self._queue if q[0] != ticket)

    def ready(self) -> bool:
        return False  # answers are made on demand, in wait_any

    def reset(self) -> None:
        self._queue.clear()


class StreamingDirectClient(_InProcess):
    """A ``StreamingEngine`` reached from the caller's thread: each submit goes
    to the engine at once, and a ticket is answered as soon as all of its
    requests are done, in whatever order tickets finish. ``engine_time_s`` is
    the time the engine had requests in flight. ``gate``: the engine lock,
    held shared by each request from its submit to its answer, or until its
    ticket is abandoned (even where the engine cannot drop it: a future that
    runs)."""

    streams = True

    def __init__(self, engine: Engine, gate: EngineGate | None = None) -> None:
        if not getattr(engine, "streams", False):
            raise TypeError(f"{type(engine).__name__} does not stream completions: use DirectClient")
        super().__init__(engine)
        self.gate = gate
        self._pending: dict[int, list[concurrent.futures.Future]] = {}
        self._flight = InFlight(engine, gate, self._busy)  # by ticket

    def _busy(self, start: float, end: float) -> None:
        self.engine_time_s += end - start

    def submit(self, requests: list[GenerationRequest], sampling: SamplingParams, hold: bool = False) -> int:
        self._next += 1
        ticket, n = self._next, len(requests)
        self._flight.enter(ticket, n)
        futures = self._flight.submit(ticket, requests, sampling)
        for i, f in enumerate(futures):
            f.add_done_callback(lambda _, i=i: self._flight.leave(ticket, i))
        self._pending[ticket] = futures
        self.engine_calls += 1
        self.batch_sizes.append(n)
        return ticket

    def _finished(self) -> int | None:
        return next((t for t, fs in self._pending.items() if all(f.done() for f in fs)), None)

    def wait_any(self, timeout: float | None = None) -> tuple[int, list[Completion]] | None:
        if not self._pending:
            raise RuntimeError("no request in flight to wait for")
        deadline = None if timeout is None else time.monotonic() + timeout
        while (ticket := self._finished()) is None:
            waiting = [f for fs in self._pending.values() for f in fs if not f.done()]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            # None (no timeout) is unbounded: the engine resolves every future it hands out (an
            # answer, an error, or its close() failing the rest); a ticket's last future done
            # makes it finished.
            concurrent.futures.wait(waiting, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED)
        futures = self._pending.pop(ticket)
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            raise EngineError(f"{type(failed).__name__}: {failed}", ticket,
                                   unavailable=isinstance(failed, EngineUnavailable)) from failed
        return ticket, [f.result() for f in futures]

    def abandon(self, ticket: int) -> None:
        self._flight.leave(ticket)
        for f in self._pending.pop(ticket, ()):
            f.cancel()  # the engine drops a request it has not answered yet

    def ready(self) -> bool:
        return self._finished() is not None

    def reset(self) -> None:
        for ticket in list(self._pending):
            self.abandon(ticket)


def direct_client(engine: Engine) -> DirectClient | StreamingDirectClient:
    """The client that calls ``engine`` from the caller's thread: streaming when the engine streams."""
    return StreamingDirectClient(engine) if getattr(engine, "streams", False) else DirectClient(engine)
