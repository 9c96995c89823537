"""``PendingFutures``: the futures a streaming engine handed out and has not resolved,
each resolved once, by the engine's answer or by ``close``."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator

from ragen.llm.types import CLOSED_BEFORE_ANSWER, resolve


class PendingFutures:
    """Thread-safe set of an engine's unresolved futures. ``add`` (or ``adding``) takes new ones
    (refused once closed), ``settle`` resolves one unless it was resolved or taken already, ``close``
    takes every one left (which the engine cancels, or fails with ``fail_closed``).
    ``on_count(change)``, called under ``lock``, follows the number pending."""

    def __init__(self, closed_message: str = "the engine is closed",
                 on_count: Callable[[int], None] | None = None) -> None:
        self.lock = threading.Lock()
        self.closed = False
        self._closed_message = closed_message
        self._on_count = on_count
        self._futures: set[Future] = set()

    def add(self, futures: Iterable[Future]) -> None:
        """Track ``futures``; RuntimeError once closed."""
        with self.adding(futures):
            pass

    @contextlib.contextmanager
    def adding(self, futures: Iterable[Future]) -> Iterator[None]:
        """Track ``futures``, the lock held through the block (``close`` either sees them
        and what the block started, or comes after both); RuntimeError once closed."""
        with self.lock:
            if self.closed:
                raise RuntimeError(self._closed_message)
            futures = list(futures)
            self._futures.update(futures)
            if self._on_count is not None:
                self._on_count(len(futures))
            yield

    def __contains__(self, future: Future) -> bool:
        with self.lock:
            return future in self._futures

    def discard(self, future: Future) -> bool:
        """Stop tracking ``future``; False when it was not pending (resolved or closed)."""
        with self.lock:
            if future not in self._futures:
                return False
            self._futures.discard(future)
            if self._on_count is not None:
                self._on_count(-1)
            return True

    def settle(self, future: Future, result: Any = None, error: BaseException | None = None) -> None:
        """Resolve ``future`` with ``result`` (or ``error``) unless it is no longer pending."""
        if self.discard(future):
            resolve(future, result, error)  # outside the lock: a callback may submit again

    def close(self) -> list[Future] | None:
        """Refuse new futures and take those still pending (untracked from now on); None
        when closed already."""
        with self.lock:
            if self.closed:
                return None
            self.closed = True
            pending = list(self._futures)
            self._futures.clear()
            if self._on_count is not None:
                self._on_count(-len(pending))
        return pending


def fail_closed(futures: Iterable[Future]) -> None:
    """Fail each of ``futures`` not done yet: the engine closed before it was answered."""
    for future in futures:
        if not future.done():
            resolve(future, error=RuntimeError(CLOSED_BEFORE_ANSWER))
