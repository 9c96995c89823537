"""The stdout and stderr of each agent episode, kept apart from every other's: ``Output``.

``sys.stdout`` and ``sys.stderr`` are replaced, once, by proxies that send a write to the
``Output`` of the context the writing code runs in (a ``contextvars.ContextVar`` an entry's
thread sets), and any other write to the stream that was there. A context variable rather than
the thread's id: an async entry's tasks and what it runs with ``asyncio.to_thread`` share its
context, so their output is its own. Threads the entry starts itself, C code and subprocesses
write to the process's streams, uncaptured.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from typing import Any, Iterator

LIMIT_CHARS = 64 * 1024  # of each stream, its last part kept


class Tail:
    """The last ``limit`` characters written to it."""

    def __init__(self, limit: int = LIMIT_CHARS) -> None:
        self.limit = limit
        self._parts: list[str] = []
        self._size = 0
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._parts.append(text)
            self._size += len(text)
            if self._size > 2 * self.limit:  # cut now and then, not at every write
                kept = "".join(self._parts)[-self.limit:]
                self._parts, self._size = [kept], len(kept)
        return len(text)

    def text(self) -> str:
        with self._lock:
            return "".join(self._parts)[-self.limit:]


class Output:
    """An episode's captured ``stdout`` and ``stderr``, each a ``Tail``."""

    def __init__(self, limit: int = LIMIT_CHARS) -> None:
        self.stdout = Tail(limit)
        self.stderr = Tail(limit)

    @contextlib.contextmanager
    def captured(self) -> Iterator[Output]:
        """What code in this context (this thread, its asyncio tasks) prints goes here meanwhile."""
        _install()
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


_CURRENT: contextvars.ContextVar[Output | None] = contextvars.ContextVar("ragen_agent_output", default=None)
_INSTALL_LOCK = threading.Lock()


class _Routed:
    """``sys.<name>``: a write to the current ``Output``'s stream, or else to ``stream``."""

    def __init__(self, stream: Any, name: str) -> None:
        self._stream = stream
        self._name = name

    def write(self, text: str) -> int:
        output = _CURRENT.get()
        if output is not None:
            return getattr(output, self._name).write(text)
        return self._stream.write(text) if self._stream is not None else len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if _CURRENT.get() is None and self._stream is not None:
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _install() -> None:
    """The proxies in ``sys.stdout``/``sys.stderr``, again where something replaced them since."""
    with _INSTALL_LOCK:
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if not isinstance(stream, _Routed):
                setattr(sys, name, _Routed(stream, name))
