"""Processes end cleanly and leave nothing behind.

Each case runs a driver (``tests/lifecycle_driver.py``) in a subprocess of
its own session and watches its process tree:

- a process whose env timed out (abandoned in a hung call) still exits;
- a driver that is terminated (SIGTERM), killed (SIGKILL) or leaves through
  ``os._exit`` leaves no worker process and no resource tracker behind;
- a rollout starts no more workers than it has groups, and a
  ``parallel_n_jobs`` far above the cores is capped with a warning.

The bounds are generous "does not hang" bounds, not timings.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[1]
EXIT_WITHIN_S = 60.0  # a driver that is done must have exited by then
GONE_WITHIN_S = 20.0  # every process of a killed driver's tree must have ended by then


def driver(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "tests.lifecycle_driver", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def alive(process: "psutil.Process") -> bool:
    """Running, not a zombie (an orphan's zombie waits for a reaper that may never come)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_tree(processes) -> None:
    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


# ----- an env that timed out does not keep its process alive ------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,limit", [("sequential", "env"), ("threading", "env"), ("threading", "rollout")])
def test_process_exits_after_an_env_timed_out(backend, limit):
    """Group 2's envs hang for an hour in step; env_timeout_s ends them in
    timeout (or rollout_timeout_s abandons their shard, and the fallback's
    env timeout ends them), the rollout returns, and the process exits (an
    abandoned call does not hold the interpreter at exit)."""
    proc = driver("timeout", backend, *(["--rollout-timeout"] if limit == "rollout" else []))
    try:
        out, err = proc.communicate(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process did not exit within {EXIT_WITHIN_S} s after its rollout returned "
                    f"(printed: {out!r})")
    assert proc.returncode == 0, err[-3000:]
    reasons = json.loads(out.strip().splitlines()[-1])
    assert reasons["4"] == reasons["5"] == "timeout"  # group 2
    assert all(r in ("done", "max_turns", "action_budget") for k, r in reasons.items() if k not in ("4", "5"))


# ----- no worker outlives its driver ---------------------------------------------------

def busy_driver(backend: str, *flags: str) -> tuple[subprocess.Popen, list]:
    """A driver running slow rollouts on 2 workers (one stuck in a long env
    step), and its descendants once both workers are busy."""
    proc = driver("serve", backend, *flags)
    line = proc.stdout.readline().strip()
    assert line == "rolling", (line, proc.stderr.read() if proc.poll() is not None else "")
    deadline = time.monotonic() + 60
    workers: list = []
    while time.monotonic() < deadline:
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "lifecycle_driver" in " ".join(
            p.cmdline()) or "popen_loky" in " ".join(p.cmdline())]
        if len(workers) >= 2:
            break
        time.sleep(0.1)
    assert len(workers) >= 2, "the driver's workers did not start"
    time.sleep(2.0)  # both take groups; one is stuck in its env's step
    return proc, psutil.Process(proc.pid).children(recursive=True)


def assert_all_gone(proc: subprocess.Popen, tree: list, expect_rc=None) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline and (proc.poll() is None or any(alive(p) for p in tree)):
        time.sleep(0.1)
    left = [(p.pid, " ".join(p.cmdline())[:100]) for p in tree if alive(p)]
    driver_rc = proc.poll()
    kill_tree(tree)
    if driver_rc is None:
        proc.kill()
    proc.communicate()
    assert driver_rc is not None, f"the driver did not end within {GONE_WITHIN_S} s"
    assert not left, f"processes left {GONE_WITHIN_S} s after the driver ended: {left}"
    if expect_rc is not None:
        assert driver_rc in expect_rc


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["loky", "multiprocessing"])
@pytest.mark.parametrize("how", ["SIGKILL", "os._exit"])
def test_no_worker_outlives_its_driver(backend, how):
    """However the driver ends (killed, or leaving through os._exit), its
    workers and resource trackers end with it. (A SIGTERM without a handler:
    the fault matrix.)"""
    proc, tree = busy_driver(backend, *(["--exit"] if how == "os._exit" else []))
    assert tree
    if how != "os._exit":
        os.kill(proc.pid, getattr(signal, how))
    assert_all_gone(proc, tree)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["loky", "multiprocessing"])
def test_sigterm_shuts_a_driver_down_as_sigint_does(backend):
    """With ``interrupt_on_sigterm`` (train.py), SIGTERM interrupts the driver:
    it closes its managers, as on Ctrl-C, and nothing is left."""
    proc, tree = busy_driver(backend, "--sigterm")
    os.kill(proc.pid, signal.SIGTERM)
    # an uncaught KeyboardInterrupt: Python ends the process with SIGINT (after the finally blocks)
    assert_all_gone(proc, tree, expect_rc={-signal.SIGINT, 128 + signal.SIGINT, 1})


def test_interrupt_on_sigterm_raises_keyboard_interrupt():
    from ragen.rollout.workers.executors import interrupt_on_sigterm

    before = signal.getsignal(signal.SIGTERM)
    try:
        interrupt_on_sigterm()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode
    finally:
        signal.signal(signal.SIGTERM, before)


# ----- workers started: no more than the groups, capped near the cores -------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["loky", "multiprocessing"])
def test_workers_beyond_the_groups_are_not_started(backend):
    """n_jobs=24 (capped at 4 per core): a rollout of 1 group starts 1 worker,
    one of 4 groups 4 (the pool grows), one of 2 after them keeps the 4;
    besides them at most 2 helpers (resource trackers)."""
    proc = driver("workers", backend, "24", "1,4,2")
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert [r["trajectories"] for r in report["rollouts"]] == [2, 8, 4]
    assert [len(r["workers"]) for r in report["rollouts"]] == [1, 4, 4], report
    assert all(len(r["others"]) <= 2 for r in report["rollouts"]), report


@pytest.mark.timeout(120)
def test_n_jobs_far_above_the_cores_is_capped_with_a_warning(caplog):
    from ragen.llm.scripted import ScriptedEngine
    from ragen.rollout.config import MAX_JOBS_PER_CORE, cap_n_jobs
    from ragen.serving import SharedLLMInferenceManager
    from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings
    from tests.lifecycle_driver import specs
    from tests.rollout_helpers import loop_config

    import joblib

    cap = MAX_JOBS_PER_CORE * joblib.cpu_count()
    with caplog.at_level(logging.WARNING, logger="ragen.rollout.config"):
        with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
                ParallelRolloutManager(shared, ParallelSettings(n_jobs=1000, backend="loky")) as prm:
            assert prm.n_workers == cap
            result = prm.rollout(specs(n_groups=3), loop_config())
    assert len(result.trajectories) == 6 and result.metrics["parallel/fallbacks"] == 0
    assert any("agent_proxy.parallel_n_jobs=1000" in r.getMessage() and f"capped at {cap}" in r.getMessage()
               for r in caplog.records)
    rule = MAX_JOBS_PER_CORE * 2  # the cap on 2 cores
    assert cap_n_jobs(rule, cores=2) == rule and cap_n_jobs(rule + 1, cores=2) == rule
    assert cap_n_jobs(-1, cores=2) == -1 and cap_n_jobs("auto", cores=2) == "auto"


@pytest.mark.timeout(300)
def test_train_py_terminated_shuts_down_and_leaves_no_worker(tiny_model_path, tmp_path):
    """train.py (parallel rollout on loky) terminated mid-run: it unwinds as on
    Ctrl-C (its finally blocks close the trainer and its workers) and no
    process of its tree is left."""
    from tests.test_train_script import _small

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    stderr = tmp_path / "stderr.txt"  # a file: a pipe nobody reads while it runs could fill and block it
    args = [a for a in _small(tiny_model_path, tmp_path / "run") if not a.startswith("trainer.total_training_steps")]
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config-name", "base-parallel",
                             f"hydra.run.dir={tmp_path / 'hydra'}", *args, "trainer.total_training_steps=1000",
                             "agent_proxy.parallel_n_jobs=2"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=stderr.open("w"),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        workers: list = []
        while time.monotonic() < deadline and proc.poll() is None:
            tree = psutil.Process(proc.pid).children(recursive=True)
            workers = [p for p in tree if "popen_loky" in " ".join(_cmdline(p))]
            if len(workers) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None and len(workers) >= 2, "train.py's rollout workers did not start"
        tree = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=EXIT_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = stderr.read_text()
    assert proc.returncode == -signal.SIGINT, err[-3000:]  # ended as an interrupted run
    assert "train.py: interrupted (signal SIGTERM)" in err and "Traceback" not in err, err[-3000:]  # one line
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline and any(alive(p) for p in tree):
        time.sleep(0.1)
    left = [(p.pid, " ".join(p.cmdline())[:100]) for p in tree if alive(p)]
    kill_tree(tree)
    assert not left, f"processes left after train.py ended: {left}"


def _cmdline(process) -> list[str]:
    """A process's command line; none for one that ended since it was listed (a short-lived child)."""
    try:
        return process.cmdline()
    except psutil.NoSuchProcess:
        return []
