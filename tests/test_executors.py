"""KeptExecutor: built once, replaced after a failure, never by reading an
executor's private state."""

from __future__ import annotations

import concurrent.futures
import os
import time

import joblib
import pytest

from ragen.rollout.workers.executors import KeptExecutor


def _exit_now():
    os._exit(3)


def _pid():
    return os.getpid()


def _loky():
    from loky import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=1)


@pytest.mark.timeout(120)
def test_a_dead_worker_is_seen_in_what_it_raises_and_its_executor_replaced_once():
    kept = KeptExecutor(_loky)
    try:
        broken = kept.get()
        assert kept.get() is broken  # kept between uses
        first = broken.submit(_pid).result(timeout=60)
        with pytest.raises(concurrent.futures.BrokenExecutor):  # loky's BrokenProcessPool derives from it
            broken.submit(_exit_now).result(timeout=60)
        kept.replace(failed=broken)
        fresh = kept.get()
        assert fresh is not broken
        kept.replace(failed=broken)  # another task of the broken executor reports it too: the successor stays
        assert kept.get() is fresh
        assert fresh.submit(_pid).result(timeout=60) != first
    finally:
        kept.close()


@pytest.mark.timeout(120)
def test_replace_and_close_stop_every_kind_of_executor(tmp_path):
    built = []

    def build():
        built.append(concurrent.futures.ThreadPoolExecutor(1))
        return built[-1]

    kept = KeptExecutor(build)
    assert kept.get().submit(lambda: 7).result(timeout=10) == 7
    kept.replace()
    with pytest.raises(RuntimeError):  # shut down: takes no more tasks
        built[0].submit(lambda: 7)
    assert kept.get() is built[1]
    kept.close()
    with pytest.raises(RuntimeError):
        built[1].submit(lambda: 7)
    kept.close()  # closing twice, or with nothing built, is fine

    # an entered joblib.Parallel on processes, and loky's executor: their worker
    # processes end on replace (no wait) and on close (wait)
    for kind, build, run in [("Parallel", _parallel, _parallel_pids), ("loky", _loky, _loky_pids)]:
        built = []
        kept = KeptExecutor(lambda: built.append(build()) or built[-1])
        try:
            for stop in (kept.replace, kept.close):
                executor = kept.get()
                pids = run(executor)
                assert pids and os.getpid() not in pids and all(map(_alive, pids)), (kind, pids)
                if kind == "loky":  # a task still running is no reason to keep its worker
                    started = tmp_path / f"{stop.__name__}-started"
                    executor.submit(_mark_and_sleep, str(started))
                    assert _within(lambda: started.exists()), "the task never started"
                stop()
                assert _all_gone(pids), f"{kind}: worker processes {sorted(pids)} still alive after {stop.__name__}"
                if kind == "loky":
                    with pytest.raises(RuntimeError):  # shut down: takes no more tasks
                        executor.submit(_pid)
            kept.close()
        finally:  # when KeptExecutor left them running, the test run must not wait for them at exit
            for executor in built:
                if kind == "loky":
                    executor.shutdown(wait=True, kill_workers=True)
                else:
                    executor.__exit__(None, None, None)


def _parallel():
    return joblib.Parallel(n_jobs=2, backend="multiprocessing").__enter__()


def _parallel_pids(parallel) -> set[int]:
    return set(parallel(joblib.delayed(_pid)() for _ in range(4)))


def _loky_pids(executor) -> set[int]:
    return {executor.submit(_pid).result(timeout=60)}


def _mark_and_sleep(path: str) -> None:
    open(path, "w").close()
    time.sleep(300)


def _within(condition, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    """Running (a zombie, dead and not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: signal 0 sees zombies as alive
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _all_gone(pids: set[int]) -> bool:
    return _within(lambda: not any(map(_alive, pids)))


@pytest.mark.timeout(60)
def test_daemon_thread_pool_runs_tasks_on_daemon_threads_and_stops():
    import threading

    from ragen.rollout.workers.executors import DaemonThreadPool

    pool = DaemonThreadPool(2, thread_name_prefix="test-pool")
    release = threading.Event()
    names = []

    def task(i):
        names.append(threading.current_thread())
        release.wait(30)
        return i * i

    futures = [pool.submit(task, i) for i in range(5)]
    release.set()
    assert [f.result(timeout=30) for f in futures] == [0, 1, 4, 9, 16]
    assert len(set(names)) <= 2 and all(t.daemon for t in names)  # at most max_workers threads, all daemons
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=30)
    blocker, started = threading.Event(), threading.Barrier(3)

    def hold():
        started.wait(30)
        return blocker.wait(30)

    running = [pool.submit(hold) for _ in range(2)]
    started.wait(30)  # both threads busy: what follows stays queued
    queued = [pool.submit(abs, -1) for _ in range(3)]
    pool.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(RuntimeError):
        pool.submit(abs, -1)
    blocker.set()
    assert [f.result(timeout=30) for f in running] == [True, True]
    assert all(f.cancelled() for f in queued)
