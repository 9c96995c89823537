"""A server that serves on a thread of its own: the env server and the retrieval server.

``start`` serves on a daemon thread (tests, benchmarks, the command lines),
``shutdown`` stops serving and waits for that thread; a ``with`` block does
both. ``serve_until_stop_signal`` is a command line's run of one: started,
announced, served until SIGINT or SIGTERM, shut down, summed up. Both want a
key on every request (``ragen.env.keys``).
"""

from __future__ import annotations

import signal
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable

__all__ = ["BackgroundServer", "serve_until_stop_signal"]


class BackgroundServer(ABC):
    """Serves at ``host``:``port`` (set by the subclass once it listens) on a thread of its own."""

    host: str
    port: int
    thread_name = "ragen-server"
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @abstractmethod
    def serve_forever(self) -> None:
        """Serve until ``_stop``."""

    @abstractmethod
    def _stop(self) -> None:
        """Make ``serve_forever`` return and close the listening socket."""

    def start(self) -> Any:
        self._thread = threading.Thread(target=self.serve_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop()
        if self._thread is not None:
            self._thread.join(timeout=10)  # serve_forever returns within its polling interval after the stop

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def serve_until_stop_signal(server: BackgroundServer, serving: str, stopped: Callable[[], str],
                            then: str | None = None) -> int:
    """A command line's server run: started, ``serving {serving} at <url>`` printed (and the line
    ``then`` after it: a generated key's), served until SIGINT or SIGTERM (the main thread's
    handlers are set here), shut down, then ``stopped after {stopped()}`` printed; the exit status 0."""
    server.start()
    print(f"serving {serving} at {server.url}", flush=True)
    if then is not None:
        print(then, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()  # a server serves until a signal says stop: nothing else ends it
    server.shutdown()
    print(f"stopped after {stopped()}", flush=True)
    return 0
