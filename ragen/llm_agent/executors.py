"""Executors kept between uses, and replaced when they fail.

``KeptExecutor`` builds its executor (a ``concurrent.futures`` executor, loky's
process executor, or an entered ``joblib.Parallel``) on first use and keeps it:
worker processes start once, not once per rollout. ``replace`` shuts it down
without waiting (worker processes killed, queued tasks cancelled; a running
thread cannot be stopped) so that the next ``get`` builds a new one.

Whether an executor broke is read from what it raised: a task whose worker
process died fails with ``concurrent.futures.BrokenExecutor`` (loky's
``BrokenProcessPool`` and ``TerminatedWorkerError`` derive from it), never from
the executor's private state.

Used by the parallel rollout (its workers and the fallback's spare process)
and by the fully-async rollout (its workers).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)


class KeptExecutor:
    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build
        self._executor: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The executor, built on first use and after ``replace``."""
        with self._lock:
            if self._executor is None:
                self._executor = self._build()
            return self._executor

    def replace(self, failed: Any = None) -> None:
        """Stop the executor without waiting (after a failure); the next
        ``get`` builds a new one. ``failed``: the executor that failed, when
        known; if it was replaced already (each of its tasks reports the
        failure), its successor is kept."""
        with self._lock:
            if failed is not None and failed is not self._executor:
                return
            executor, self._executor = self._executor, None
        _shut_down(executor, wait=False)

    def close(self, wait: bool = True) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        _shut_down(executor, wait)


def _shut_down(executor: Any, wait: bool) -> None:
    if executor is None:
        return
    import joblib
    from loky import ProcessPoolExecutor

    try:
        if isinstance(executor, joblib.Parallel):
            executor.__exit__(None, None, None)
        elif isinstance(executor, ProcessPoolExecutor):
            executor.shutdown(wait=wait, kill_workers=True)
        else:
            executor.shutdown(wait=wait, cancel_futures=True)
    except Exception:  # stopping a failed executor is best effort
        logger.debug("shutting the executor down failed", exc_info=True)
