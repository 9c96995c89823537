"""What a parallel worker runs: a ``WorkerTask`` that plays its specs and the
chunks of groups it takes from a rollout's queue (``run_worker``), and the
isolated re-run of groups no worker brought back (``run_isolated``). A task
and its ``WorkerResult`` are plain frozen data that cross the process
boundary."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Sequence

from ragen.rollout.agent_episode import agent_program
from ragen.rollout.agent_play import agent_stats, play_agents
from ragen.rollout.batching import choose_batching
from ragen.rollout.env_calls import KeptEnvs
from ragen.rollout.loop_config import LoopConfig, LoopStats
from ragen.rollout.scheduler import run_envs
from ragen.rollout.types import EnvSpec, StopReason, Trajectory
from ragen.rollout.workers.dispatch import report_finished, report_groups_done, take_chunk
from ragen.rollout.workers.executors import KeptExecutor, freeze_once
from ragen.rollout.workers.schedule import groups_of
from ragen.serving import SharedLLMClient

logger = logging.getLogger(__name__)

_LOCAL = threading.local()


def _worker_envs() -> KeptEnvs:
    """This process's (and thread's) env instances, kept between rollouts."""
    by_pid = getattr(_LOCAL, "kept_envs", None)
    if by_pid is None:
        by_pid = _LOCAL.kept_envs = {}
    return by_pid.setdefault(os.getpid(), KeptEnvs())


@dataclass(frozen=True)
class WorkerResult:
    """What one worker task hands back to the driver: its trajectories, the
    loop's counts, the error that failed it, and where and how long it ran."""

    task: int
    trajectories: list[Trajectory] = field(default_factory=list)  # none when ``error`` is set
    stats: LoopStats = field(default_factory=LoopStats)
    error: str | None = None  # why the task failed as a whole (not an env's own failure)
    pid: int = -1  # the process that ran it; -1: put together by the fallback from its parts
    wall_s: float = 0.0
    cause: str | None = None  # why the fallback re-ran it, when it did
    started_at: float = 0.0  # time.monotonic() in the worker when it began (comparable on one machine)
    ipc_s: float = 0.0  # its messages' time on the wire (SharedLLMClient.transit)

    @classmethod
    def combine(cls, task: int, parts: Sequence["WorkerResult"]) -> "WorkerResult":
        """One result from the results of its parts (the isolated re-run splits its groups)."""
        return cls(task=task, trajectories=[t for p in parts for t in p.trajectories],
                   stats=sum((p.stats for p in parts), LoopStats()))


@dataclass(frozen=True)
class WorkerTask:
    """One worker task: ``specs``, and with ``groups`` the chunks of them it takes from the
    rollout's queue (``dispatch.take_chunk``) as it frees up, each chunk a stream of its own
    once ``pipeline_depth`` streams play (``batching.Lockstep``); at most ``max_live_envs``
    envs at once (None: no limit). ``isolate_errors``: an env's failure ends its own
    trajectory (the fallback's), else the task's."""

    task: int
    specs: list[EnvSpec]
    client: SharedLLMClient
    config: LoopConfig
    isolate_errors: bool = False
    groups: list[list[EnvSpec]] | None = None
    max_live_envs: int | None = None
    pipeline_depth: int = 1
    report_groups: bool = False  # tell the driver each group ended whole (an over-sampled rollout)
    # the agent specs among ``specs`` (env_type: agent) are played beside the env loop, at most
    # agent_concurrency at once, on a gateway over this model (ragen.rollout.agent_play)
    agent_model: Any = None
    agent_concurrency: int = 1


def with_env_limit(config: LoopConfig, limit_s: float) -> LoopConfig:
    """``config`` with ``limit_s`` on each env call where it sets none (the fallback's)."""
    return config if config.env_timeout_s else replace(config, env_timeout_s=limit_s)


def run_worker(task: WorkerTask) -> WorkerResult:
    """One worker's task, played by ``run_envs``. Failures come back as data, not
    exceptions, so the executor does not cancel the other workers."""
    started_at, t0 = time.monotonic(), time.perf_counter()
    freeze_once()
    client, groups = task.client, task.groups
    take = None if groups is None else (lambda: [s for i in take_chunk(client) for s in groups[i]])
    client.drop_if_closed()
    transit_before = client.transit()[0]
    batching = choose_batching(task.config, client.streams, task.pipeline_depth, task.max_live_envs)
    agents = _AgentRun(task, [s for s in task.specs if s.is_agent])
    try:
        trajectories, stats = run_envs([s for s in task.specs if not s.is_agent], client, task.config, _worker_envs(),
                                       task.isolate_errors, batching=batching, take=take,
                                       on_finished=partial(report_finished, client),
                                       groups_done=partial(report_groups_done, client) if task.report_groups else None)
        played = agents.join()
        trajectories, stats = trajectories + played, stats + agent_stats(played)
        for t in trajectories:
            t.worker = os.getpid()
        error = None
    except Exception as exc:  # any failure of the task is reported as data (see above)
        with contextlib.suppress(Exception):
            agents.join()  # no episode left running behind the result
        trajectories, stats, error = [], LoopStats(), f"{type(exc).__name__}: {exc}"
    return WorkerResult(task=task.task, trajectories=trajectories, stats=stats, error=error, pid=os.getpid(),
                        wall_s=time.perf_counter() - t0, started_at=started_at,
                        ipc_s=max(0.0, client.transit()[0] - transit_before))


class _AgentRun:
    """A task's agent episodes, played on a thread of their own beside the env loop (``join``: their
    trajectories). Each one that ends is told to the driver (the rollout's progress), and each group
    of them that ends whole where the task reports groups."""

    def __init__(self, task: WorkerTask, specs: list[EnvSpec]) -> None:
        self._task = task
        self._specs = specs
        self._left = {s.group_id: 0 for s in specs}
        for s in specs:
            self._left[s.group_id] += 1
        self._broken: set[int] = set()
        self._result: list[Trajectory] = []
        self._error: BaseException | None = None
        self._thread = None
        if specs and task.agent_model is None:
            self._error = ValueError("the task has agent specs but no agent_model to serve their calls with")
        elif specs:
            self._thread = threading.Thread(target=self._run, name="ragen-agents", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        task = self._task
        try:
            self._result = play_agents(self._specs, task.client, task.agent_model, task.config.sampling,
                                       task.config.max_abs_reward, task.agent_concurrency,
                                       task.config.engine_timeout_s, self._finished)
        except BaseException as exc:  # handed to join()
            self._error = exc

    def _finished(self, traj: Trajectory) -> None:
        client = self._task.client
        report_finished(client, 1)
        if traj.stop_reason in (StopReason.ERROR, StopReason.TIMEOUT):
            self._broken.add(traj.group_id)
        self._left[traj.group_id] -= 1
        if self._task.report_groups and not self._left[traj.group_id] and traj.group_id not in self._broken:
            report_groups_done(client, 1)
        client.send_notes()  # this thread sends nothing else

    def join(self) -> list[Trajectory]:
        """The agent episodes' trajectories once all ended; what failed their player raised."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def agent_timeout_s(spec: EnvSpec) -> float:
    """How long an agent spec's episode may run (its tag's ``timeout_s``, and a grace to stop it)."""
    return agent_program(spec)[0].timeout_s + 10.0


def run_isolated(spare: KeptExecutor, task: int, specs: list[EnvSpec], client: SharedLLMClient,
                 config: LoopConfig, env_timeout_s: float, agent_model: Any = None) -> WorkerResult:
    """Run specs one group after another in the spare process, with per-env
    isolation, each env call within ``config.env_timeout_s`` or else
    ``env_timeout_s``; if the process dies, split until the env that kills it
    is found: that env gets an ``error`` trajectory, the others their results."""
    limited = with_env_limit(config, env_timeout_s)
    timeout = limited.env_timeout_s * (config.max_turn + 2) * (1 + config.env_retries) * max(1, len(specs))
    timeout += sum(agent_timeout_s(s) for s in specs if s.is_agent)
    try:
        future = spare.get().submit(run_worker, WorkerTask(task, specs, client, limited, isolate_errors=True,
                                                           agent_model=agent_model,
                                                           agent_concurrency=config.agent_max_concurrent))
        return future.result(timeout=timeout)
    except (concurrent.futures.BrokenExecutor, TimeoutError, OSError) as exc:
        spare.replace()
        cause = f"{type(exc).__name__}: {exc}".strip() or type(exc).__name__
        groups = groups_of(specs)
        parts = groups if len(groups) > 1 else [[s] for s in specs]
        if len(parts) == 1:
            s = specs[0]
            reason = StopReason.TIMEOUT if isinstance(exc, TimeoutError) else StopReason.ERROR
            logger.warning("[Fallback] env_id %d (tag %s) failed again in the fallback process: %s",
                           s.env_id, s.tag, cause)
            traj = Trajectory(env_id=s.env_id, group_id=s.group_id, tag=s.tag, seed=s.seed,
                              stop_reason=reason, error=f"worker process failed: {cause}")
            return WorkerResult(task=task, trajectories=[traj])
        return WorkerResult.combine(task, [run_isolated(spare, task, part, client, config, env_timeout_s, agent_model)
                                           for part in parts])
