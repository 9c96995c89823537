"""``InFlight``: a streaming engine's request lists, from their submit until each request is done.

Each request holds the engine gate shared (where there is one) from its
submit until its future is done or its request list is given up, and leaves
it once; each spell with requests in flight is told to ``busy``. It is the
one way a request list goes to a ``StreamingEngine``, for the caller's thread
(``StreamingDirectClient``) and for the manager (``Streamer``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable, Hashable

from ragen.llm.types import GenerationRequest, SamplingParams, StreamingEngine, TokenSink
from ragen.serving.gate import EngineGate


class InFlight:
    """The requests of a ``StreamingEngine`` in flight, by the key of their request list.

    ``lock`` guards the counts: a caller that keeps state of its own beside
    them passes its lock and calls ``release`` under it. ``busy(start, end)``:
    each spell with requests in flight, read on ``clock``."""

    def __init__(self, engine: StreamingEngine, gate: EngineGate | None, busy: Callable[[float, float], None],
                 lock: threading.Lock | threading.RLock | threading.Condition | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.gate = gate
        self.lock = lock if lock is not None else threading.Lock()
        self._busy = busy
        self._clock = clock
        self._holding: dict[Hashable, set[int]] = {}  # by key: its requests not done, not given up
        self._count = 0
        self._busy_since = 0.0

    def enter(self, key: Hashable, n: int, timeout: float | None = None) -> None:
        """``n`` requests of ``key`` go in flight: into the gate (``GateTimeout`` past
        ``timeout``, and then none is in flight), then counted."""
        if self.gate is not None:
            self.gate.enter(n, timeout=timeout)
        with self.lock:
            if self._count == 0:
                self._busy_since = self._clock()
            self._count += n
            self._holding[key] = set(range(n))

    def submit(self, key: Hashable, requests: list[GenerationRequest], sampling: SamplingParams,
               on_tokens: TokenSink | None = None) -> list[Future]:
        """The engine's futures for ``requests`` (entered under ``key``), one a request
        (``StreamingEngine.checked``); ``on_tokens``: where the new ids of those that stream
        go. When the engine refuses them or breaks its contract, every request of ``key``
        leaves and the error is raised."""
        try:
            got = self.engine.submit(requests, sampling) if on_tokens is None else \
                self.engine.submit_reporting(requests, sampling, on_tokens)
            return self.engine.checked(got, len(requests))
        except BaseException:  # whatever it is, the requests must not hold the gate
            self.leave(key)
            raise

    def release(self, key: Hashable, requests: set[int] | None = None) -> int:
        """``requests`` of ``key`` (None: all of them) out of the count, each once; the caller
        holds ``lock`` and tells the gate (``gate.leave``) after. Returns how many left."""
        holding = self._holding.get(key)
        if holding is None:
            return 0
        gone = len(holding) if requests is None else len(holding & requests)
        if requests is None:
            holding.clear()
        else:
            holding -= requests
        if not holding:
            del self._holding[key]
        self._count -= gone
        if gone and self._count == 0:
            self._busy(self._busy_since, self._clock())
        return gone

    def leave(self, key: Hashable, i: int | None = None) -> int:
        """Request ``i`` of ``key`` (None: all of them) out of flight and the gate, once."""
        with self.lock:
            gone = self.release(key, None if i is None else {i})
        if gone and self.gate is not None:
            self.gate.leave(gone)
        return gone

    def holds(self, key: Hashable) -> bool:
        """Whether a request of ``key`` is in flight (call under ``lock``)."""
        return key in self._holding
