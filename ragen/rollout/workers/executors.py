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

``DaemonThreadPool`` is a thread pool whose threads never hold the process
at exit: a task abandoned past a time limit (an env call past
``env_timeout_s``, a shard past ``rollout_timeout_s``) runs on, but the
process can still exit.

No worker outlives its driver. Worker processes run ``start_worker`` first:
a daemon thread ends the worker once its parent process is gone, however the
driver ended (SIGKILL, ``os._exit``, a crash). ``interrupt_on_sigterm`` makes
SIGTERM raise ``KeyboardInterrupt`` in a driver's main thread, as SIGINT does,
so that a terminated driver stops its workers in the same ``finally`` blocks.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import queue
import signal
import threading
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)


class KeptExecutor:
    """An executor built on first use and kept until ``replace`` (after a failure) or ``close``; see
    the module docstring."""

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


class DaemonThreadPool(concurrent.futures.Executor):
    """A ``concurrent.futures`` thread pool of daemon threads, started as tasks
    need them (at most ``max_workers``). ``ThreadPoolExecutor``'s threads are
    joined when the interpreter exits, so one task that never returns (an env
    hanging, abandoned past its time limit) would keep the process from exiting."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "ragen-pool") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # threads waiting for a task
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._tasks.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max_workers:
                thread = threading.Thread(target=self._work, name=f"{self._prefix}_{len(self._threads)}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)
        return future

    def _work(self) -> None:
        # Unbounded wait: an idle thread waits for its next task or shutdown's
        # stop; as a daemon it never holds the process.
        while (item := self._tasks.get()) is not None:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)
            del item, future, fn, args, kwargs  # what a task holds (an env) is not kept by an idle thread
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._tasks.put(None)  # each thread stops after the task it runs, if that ever returns
        if wait:
            for thread in threads:
                thread.join()  # unbounded: the caller asked to wait for the running tasks


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


LOCAL_POOLS = ("loky", "multiprocessing", "threading")  # the executors built on this machine


def local_pool(kind: str, n_workers: int, name: str) -> concurrent.futures.Executor:
    """A pool of ``n_workers`` workers on this machine, which hands each task's
    result back as it ends and sees a worker process die (``BrokenExecutor``).

    - ``loky``: loky's process executor (the one under joblib's loky backend);
      its workers tune their collector (``_worker_gc``) and share the cores
      among the thread pools of numeric libraries.
    - ``multiprocessing``: the standard library's process pool with
      multiprocessing's default start method (what joblib's multiprocessing
      backend uses); unlike ``multiprocessing.Pool`` it sees a worker die.
    - ``threading``: daemon threads (``DaemonThreadPool``), so a task
      abandoned past its time limit never holds the process at exit.

    Worker processes exit with their driver (``start_worker``).
    """
    if kind == "loky":
        from loky import ProcessPoolExecutor

        return ProcessPoolExecutor(max_workers=n_workers, env=_thread_limits(n_workers),
                                   initializer=_worker_start, initargs=(os.getpid(),))
    if kind == "multiprocessing":
        import multiprocessing

        return concurrent.futures.ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context(),
                                                      initializer=start_worker, initargs=(os.getpid(),))
    if kind == "threading":
        return DaemonThreadPool(n_workers, thread_name_prefix=name)
    raise ValueError(f"no local pool of kind {kind!r}; choose one of {LOCAL_POOLS}")


_FREEZE_PENDING = False  # a loky worker process (_worker_gc) before its first task


def _worker_start(parent_pid: int) -> None:
    """A loky worker process's start: it exits with its driver (``start_worker``) and tunes its collector."""
    start_worker(parent_pid)
    _worker_gc()


def _worker_gc() -> None:
    """A loky worker process's garbage collector: young collections every
    10,000 new objects (not 700), and, from its first task on, what it has
    imported left out of full collections (``freeze_once``). Env code creates
    objects fast (Sokoban's room search), and with the default thresholds a
    worker spends a noticeable share of its time in full collections that
    find nothing to free (BENCHMARKS.md)."""
    global _FREEZE_PENDING
    _FREEZE_PENDING = True
    gc.set_threshold(10_000, 10, 10)


def freeze_once() -> None:
    """Called at the start of each task: the first one in a loky worker leaves
    what the worker has imported (modules, classes) out of full collections."""
    global _FREEZE_PENDING
    if _FREEZE_PENDING:
        _FREEZE_PENDING = False
        gc.freeze()


def _thread_limits(n_workers: int) -> dict[str, str]:
    """Thread pools of numeric libraries in each worker process: a share of
    the cores, unless set already (what joblib's loky backend does)."""
    share = str(max(1, (os.cpu_count() or 1) // n_workers))
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
             "VECLIB_MAXIMUM_THREADS", "NUMBA_NUM_THREADS", "NUMEXPR_NUM_THREADS")
    return {name: os.environ.get(name, share) for name in names}
