"""``ManagerStats``: the counters of what the manager did, safe to read while its threads write."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ManagerStats:
    """What the manager did, written by its threads (batcher, connections).
    Metrics code reads while they write: ``batch_sizes`` and ``call_spans``
    are copies taken under the lock (a deque cannot be iterated while the
    batcher appends to it), and ``snapshot()`` is one consistent copy of
    everything."""

    engine_calls: int = 0
    requests: int = 0
    engine_time_s: float = 0.0
    coalesce_wait_s: float = 0.0  # the engine free and requests queued, held for more (summed over calls)
    messages_in: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    refused_clients: int = 0
    bad_messages: int = 0
    # the streams open as each coalesced engine call started, summed, and those calls: a worker's
    # stream with work left, and each gateway call read and not yet answered
    streams_at_calls: int = 0
    calls_started: int = 0
    _batch_sizes: deque = field(default_factory=lambda: deque(maxlen=8192), repr=False)  # the most recent calls'
    _call_spans: deque = field(default_factory=lambda: deque(maxlen=8192), repr=False)  # (start, end), monotonic
    _lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._batch_sizes)

    @property
    def call_spans(self) -> tuple[tuple[float, float], ...]:
        with self._lock:
            return tuple(self._call_spans)

    def add(self, **counts: int) -> None:
        """Add to counters (``+=`` from several threads loses updates)."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def record_call(self, batch_sizes: list[int], span: tuple[float, float], seconds: float) -> None:
        """One engine call of ``batch_sizes`` chunks."""
        with self._lock:
            self.engine_calls += len(batch_sizes)
            self._batch_sizes.extend(batch_sizes)
            self.requests += sum(batch_sizes)
            self.engine_time_s += seconds
            self._call_spans.append(span)

    def record_submit(self, n: int) -> None:
        """A request list of ``n`` handed to a streaming engine (counted as a call of its size)."""
        with self._lock:
            self.engine_calls += 1
            self._batch_sizes.append(n)
            self.requests += n

    def record_busy(self, span: tuple[float, float]) -> None:
        """A streaming engine had requests in flight from ``span[0]`` to ``span[1]`` (monotonic)."""
        with self._lock:
            self.engine_time_s += span[1] - span[0]
            self._call_spans.append(span)

    def snapshot(self) -> "ManagerStats":
        with self._lock:
            return ManagerStats(**{**{k: v for k, v in self.__dict__.items() if k != "_lock"},
                                   "_batch_sizes": deque(self._batch_sizes, maxlen=8192),
                                   "_call_spans": deque(self._call_spans, maxlen=8192)})
