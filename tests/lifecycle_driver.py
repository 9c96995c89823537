"""A driver process for the process-lifecycle tests (tests/test_process_lifecycle.py).

    python -m tests.lifecycle_driver timeout BACKEND [--rollout-timeout]
        one rollout whose group 2 hangs for an hour in step, with env_timeout_s
        (--rollout-timeout: with rollout_timeout_s instead, the fallback's env
        timeout ending the group); prints the stop reasons as JSON and returns
        (the process must then exit)
    python -m tests.lifecycle_driver serve BACKEND [--sigterm] [--exit]
        slow rollouts, one after another, until killed; prints "rolling" once
        the first has started. --sigterm: SIGTERM interrupts, as in train.py;
        --exit: leaves through os._exit once the workers are busy
    python -m tests.lifecycle_driver workers BACKEND N_JOBS N_GROUPS[,N_GROUPS...]
        one rollout of each size; prints JSON: after each, this process's
        worker processes and other descendants; the manager's n_workers
"""

from __future__ import annotations

import json
import os
import sys

from ragen.llm.scripted import ScriptedEngine
from ragen.serving import DirectClient, SharedLLMInferenceManager
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings
from ragen.rollout.scheduler import KeptEnvs, run_envs

from tests.rollout_helpers import custom_envs, fault_tag, loop_config, specs_for

BAD = 2


def specs(n_groups: int = 6, **fault_kw):
    clean = specs_for(["Fault"], [n_groups], 2, custom_envs(Fault=fault_tag()))
    bad_seed = next((s.seed for s in clean if s.group_id == BAD), -1)
    return specs_for(["Fault"], [n_groups], 2, custom_envs(Fault=fault_tag(fault_seed=bad_seed, **fault_kw)))


def descendants() -> dict[str, list[int]]:
    """This process's descendants: its worker processes (loky's, or forked
    copies of this one), and the others (resource trackers)."""
    import psutil

    out: dict[str, list[int]] = {"workers": [], "others": []}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:  # a worker of a pool replaced by a larger one, not reaped yet
                continue
            command = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        out["workers" if "popen_loky" in command or "lifecycle_driver" in command else "others"].append(p.pid)
    return out


def timeout(backend: str, per_rollout: bool) -> None:
    hanging = specs(fault="hang_step", hang_s=3600.0)
    config = loop_config(env_timeout_s=None if per_rollout else 0.5)
    if backend == "sequential":
        trajectories, _ = run_envs(hanging, DirectClient(ScriptedEngine()), config, kept_envs=KeptEnvs())
    else:
        limits = {"rollout_timeout_s": 2.0, "fallback_env_timeout_s": 0.5} if per_rollout else {}
        with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
                ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend=backend, **limits)) as prm:
            trajectories = prm.rollout(hanging, config).trajectories
    print(json.dumps({str(t.env_id): str(t.stop_reason) for t in trajectories}), flush=True)


def serve(backend: str, sigterm: bool, leave: bool) -> None:
    if sigterm:
        from ragen.rollout.workers.executors import interrupt_on_sigterm

        interrupt_on_sigterm()
    # slow steps, and one group that hangs in its first step: a worker busy for minutes
    slow = specs(n_groups=4, step_cost_s=0.2, fault="hang_step", hang_s=600.0)
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend=backend)) as prm:
        if leave:
            import threading

            threading.Timer(3.0, lambda: os._exit(0)).start()
        print("rolling", flush=True)
        while True:
            prm.rollout(slow, loop_config(max_turn=50))


def workers(backend: str, n_jobs: int, group_counts: list[int]) -> None:
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=n_jobs, backend=backend)) as prm:
        rollouts = []
        for n_groups in group_counts:
            result = prm.rollout(specs(n_groups=n_groups), loop_config())
            rollouts.append({**descendants(), "trajectories": len(result.trajectories)})
        print(json.dumps({"rollouts": rollouts, "n_workers": prm.n_workers}), flush=True)


if __name__ == "__main__":
    command, backend = sys.argv[1], sys.argv[2]
    if command == "timeout":
        timeout(backend, "--rollout-timeout" in sys.argv)
    elif command == "serve":
        serve(backend, "--sigterm" in sys.argv, "--exit" in sys.argv)
    elif command == "workers":
        workers(backend, int(sys.argv[3]), [int(n) for n in sys.argv[4].split(",")])
    else:
        raise SystemExit(f"unknown command {command!r}")
