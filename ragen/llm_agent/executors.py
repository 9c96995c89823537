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

No worker outlives its driver. Worker processes run ``start_worker`` first:
a daemon thread ends the worker once its parent process is gone, however the
driver ended (SIGKILL, ``os._exit``, a crash). ``interrupt_on_sigterm`` makes
SIGTERM raise ``KeyboardInterrupt`` in a driver's main thread, as SIGINT does,
so that a terminated driver stops its workers in the same ``finally`` blocks.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
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
    import concurrent.futures

    import joblib
    from loky import ProcessPoolExecutor

    try:
        if isinstance(executor, joblib.Parallel):
            executor.__exit__(None, None, None)
        elif isinstance(executor, ProcessPoolExecutor):
            executor.shutdown(wait=wait, kill_workers=True)
        else:
            if isinstance(executor, concurrent.futures.ProcessPoolExecutor):
                _kill_workers(executor)  # a shard still running would keep its worker (and shutdown) waiting
            executor.shutdown(wait=wait, cancel_futures=True)
    except Exception:  # stopping a failed executor is best effort
        logger.debug("shutting the executor down failed", exc_info=True)


def _kill_workers(executor: Any) -> None:
    """The worker processes of a ``concurrent.futures.ProcessPoolExecutor``
    killed (its ``terminate_workers`` where Python has it)."""
    terminate = getattr(executor, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(executor, "_processes", None) or {}).values()):
        try:
            process.kill()
        except Exception:  # gone already
            logger.debug("killing a worker failed", exc_info=True)


PARENT_POLL_S = 0.5  # how often a worker looks whether its driver is still there


def start_worker(parent_pid: int) -> None:
    """The first thing a worker process runs (an executor's ``initializer``):
    it exits once ``parent_pid`` is no longer its parent.

    A thread polls ``os.getppid()``: a process whose parent dies is handed to
    another (init, or a subreaper). Linux's ``PR_SET_PDEATHSIG`` is not used:
    it fires when the *thread* that started the worker ends, and executors
    start workers from whichever thread submits or from their own management
    thread, which may end while the driver lives.
    """
    if os.getppid() != parent_pid:  # the driver died before this worker started
        os._exit(1)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="ragen-parent-watch", daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    # Unbounded by design: it watches for as long as the worker lives (a daemon thread).
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    logger.warning("worker %d: its driver (pid %d) is gone; exiting", os.getpid(), parent_pid)
    os._exit(1)  # the main thread may be blocked on the dead driver's connection


def interrupt_on_sigterm() -> None:
    """SIGTERM raises ``KeyboardInterrupt`` in the main thread, as SIGINT does:
    the driver unwinds through its ``finally`` blocks and ``close()``s, which
    stop its worker processes (by default SIGTERM ends a Python process at
    once, and its workers only notice through ``start_worker``'s watch).
    Call it from a command's main thread (``train.py`` does)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupt)
