"""The parallel backend: a rollout's groups played by joblib workers around one shared engine.

Workers (``agent_proxy.parallel_backend``: loky processes by default,
threading, multiprocessing, sequential, dask, ray) take chunks of whole groups
from the rollout's queue as they free up (``workers.schedule``,
``workers.dispatch``), play them with the turn loop (``workers.task``), keep
their envs between rollouts, and ask the driver's
``SharedLLMInferenceManager`` for every answer. The groups a worker did not
bring back (its process died, the rollout passed ``rollout_timeout_s``) get one
parallel retry, then the fallback re-runs them with the same seeds, one group
at a time, isolated from the driver; every spec gets exactly one trajectory,
merged in env_id order. docs/parallel_rollout.md is the guide.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import pickle
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

import joblib

from ragen.errors import ConfigError, RagenError
from ragen.rollout.agent_play import AgentModel
from ragen.rollout.backends.base import SyncBackend
from ragen.rollout.backends.lease import ExecutorLease
from ragen.rollout.config import BACKENDS, AgentProxyConfig, cap_n_jobs, check_n_jobs, check_time_limit
from ragen.rollout.loop_config import LoopConfig, LoopStats
from ragen.rollout.metrics import EngineUse, engine_idle, rollout_metrics
from ragen.rollout.progress import RolloutProgress
from ragen.rollout.types import EnvSpec, RolloutResult, Trajectory
from ragen.rollout.workers.autosize import AutoSizer, Measured
from ragen.rollout.workers.cluster import ClusterConfig, open_cluster
from ragen.rollout.workers.dispatch import announced
from ragen.rollout.workers.executors import LOCAL_POOLS
from ragen.rollout.workers.schedule import GroupQueue, group_cost_s, groups_of, min_chunk_groups
from ragen.rollout.workers.task import WorkerResult, WorkerTask, run_isolated, run_worker, with_env_limit
from ragen.serving import SharedLLMInferenceManager
from ragen.serving.gate import EngineGate
from ragen.utils import closed_on_failure

logger = logging.getLogger(__name__)

IN_PROCESS_BACKENDS = ("threading", "sequential")  # workers run in the driver process


class RolloutError(RagenError, RuntimeError):
    """A rollout that could not give every spec its trajectory."""


def worker_wait_s(engine_timeout_s: float | None, manager_times_out: bool) -> float | None:
    """How long a worker waits for the manager's answer. Where the manager ends a request
    that ran past ``engine_timeout_s`` itself (a streaming engine: its envs then end in
    ``timeout``), the worker's wait is only the backstop for a manager that does not answer,
    and leaves that answer a grace to arrive (else the worker's wait, which starts first,
    runs out first, and its whole task goes to the fallback)."""
    if engine_timeout_s is None or not manager_times_out:
        return engine_timeout_s
    return engine_timeout_s + max(1.0, 0.1 * engine_timeout_s)


@dataclass(frozen=True)
class ParallelSettings:
    """What a ``ParallelRolloutManager`` is built with: the ``agent_proxy`` keys of its name
    (``of``), and ``fallback_env_timeout_s``, the fallback's bound on an env call where
    ``env_timeout_s`` sets none. Checked here, as the config reader checks them."""

    n_jobs: int | str = -1  # agent_proxy.parallel_n_jobs
    backend: str = "loky"  # agent_proxy.parallel_backend
    max_env_num_per_worker: int | None = None
    fallback_to_sequential: bool = True
    rollout_timeout_s: float | None = None
    fallback_env_timeout_s: float = 60.0
    engine_timeout_s: float | None = None
    max_concurrent_rollouts: int | None = None
    pipeline_depth: int = AgentProxyConfig.pipeline_depth

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"agent_proxy.parallel_backend: unknown {self.backend!r}; choose one of {BACKENDS}")
        check_n_jobs(self.n_jobs)
        for key in ("rollout_timeout_s", "engine_timeout_s", "fallback_env_timeout_s"):
            check_time_limit(key, getattr(self, key))
        if self.max_env_num_per_worker is not None and self.max_env_num_per_worker < 1:
            raise ConfigError(f"agent_proxy.max_env_num_per_worker must be >= 1, got {self.max_env_num_per_worker}")

    @classmethod
    def of(cls, ap: AgentProxyConfig) -> "ParallelSettings":
        return cls(n_jobs=ap.parallel_n_jobs, backend=ap.parallel_backend,
                   max_env_num_per_worker=ap.max_env_num_per_worker, fallback_to_sequential=ap.fallback_to_sequential,
                   rollout_timeout_s=ap.rollout_timeout_s, engine_timeout_s=ap.engine_timeout_s,
                   max_concurrent_rollouts=ap.max_concurrent_rollouts, pipeline_depth=ap.pipeline_depth)


class ParallelRolloutManager(SyncBackend):
    """``use_parallel_rollout: true``: a rollout's envs played by joblib workers
    that take whole groups as they free up, all asking ``shared`` (one engine
    in the driver) for generations. Keeps its executors and the workers' envs
    between rollouts; groups a worker did not bring back are re-run by the
    fallback, so every spec gets its trajectory. ``owns_serving``: ``close()``
    stops ``shared`` too (``make_backend`` built it for this manager)."""

    def __init__(self, shared: SharedLLMInferenceManager, settings: ParallelSettings = ParallelSettings(),
                 cluster: ClusterConfig | None = None, *, owns_serving: bool = False) -> None:
        super().__init__(settings.max_concurrent_rollouts, shared, owns_serving)
        self.settings = settings
        n_jobs, backend = settings.n_jobs, settings.backend
        if backend in LOCAL_POOLS or (backend == "dask" and not (cluster and cluster.dask_scheduler_address)):
            n_jobs = cap_n_jobs(n_jobs)  # processes (or threads) on this machine
        self.shared = shared
        self.engine = shared.engine
        self.n_jobs = n_jobs
        self.pipeline_depth = settings.pipeline_depth  # a worker's streams; with auto, each rollout's choice
        manager_times_out = shared.streamer is not None and shared.streamer.request_timeout_s is not None
        self._client = shared.client(timeout_s=worker_wait_s(settings.engine_timeout_s, manager_times_out))
        # executors kept between rollouts; one rollout at a time on each (see ExecutorLease)
        self._lock = threading.Lock()
        self._idle: list[ExecutorLease] = []
        self._leased: set[ExecutorLease] = set()
        self._closed = False
        self._rollouts_running = 0  # rollouts with tasks on the workers now (for a cluster's announcements)
        self._picklable: set[tuple] = set()  # reuse keys whose env config is known to pickle
        # dask, ray: a cluster client held until close(); the workers get an address they can reach
        auto = n_jobs == "auto"
        self._cluster = open_cluster(backend, cluster, -1 if auto else n_jobs)
        with closed_on_failure(self.close):  # any failure, an interrupt too: what was started is closed
            if self._cluster is not None:
                self._client = self._cluster.worker_client(self._client)
            with joblib.parallel_config(backend=self._joblib_backend()):
                # auto: a pool of one process per core, of which each rollout uses as many as chosen
                self.n_workers = 1 if backend == "sequential" else joblib.effective_n_jobs(-1 if auto else n_jobs)
        self._auto = AutoSizer(self.n_workers) if auto else None
        self._group_s: float | None = None  # env time of a group, measured on the last rollout (chunk sizes)
        self._agent_model: AgentModel | None = None  # read from the engine at the first rollout with agent tags

    def _agent_model_for(self, specs: Sequence[EnvSpec]) -> AgentModel | None:
        """What the workers serve the agent episodes' calls with, where ``specs`` hold any."""
        if not any(s.is_agent for s in specs):
            return None
        if self._agent_model is None:
            model = AgentModel.of(self.engine)
            if self.settings.backend not in IN_PROCESS_BACKENDS:
                try:
                    pickle.dumps(model)
                except Exception as exc:  # noqa: BLE001 - whatever the tokenizer raises, said once, here
                    raise RolloutError(f"the engine's tokenizer cannot be sent to the workers that serve the agent "
                                       f"tags' calls ({type(exc).__name__}: {exc}); set agent_proxy.parallel_backend="
                                       f"threading") from exc
            self._agent_model = model
        return self._agent_model

    def _joblib_backend(self):
        return self._cluster.joblib_backend() if self._cluster is not None else self.settings.backend

    # ----- executors ------------------------------------------------------------
    @contextlib.contextmanager
    def _lease(self) -> Iterator[ExecutorLease]:
        """The executors of one rollout: an idle one kept from an earlier
        rollout, or a new one while every kept one is in use (rollouts at once)."""
        with self._lock:
            if self._closed:
                raise RolloutError("the ParallelRolloutManager is closed")
            lease = self._idle.pop() if self._idle else ExecutorLease(self)
            self._leased.add(lease)
        try:
            yield lease
        finally:
            with self._lock:
                self._leased.discard(lease)
                keep = not self._closed
                if keep:
                    self._idle.append(lease)
            if not keep:
                lease.close()

    def _results(self, lease: ExecutorLease, calls: list[WorkerTask]) -> Iterator[WorkerResult]:
        """``run_worker`` on each task; results as tasks finish.
        Raises TimeoutError past rollout_timeout_s, or the executor's error
        when a worker died."""
        executor = lease.workers_for(len(calls))
        if isinstance(executor, joblib.Parallel):
            yield from executor(joblib.delayed(run_worker)(task) for task in calls)
            return
        pending = {executor.submit(run_worker, task) for task in calls}
        limit = self.settings.rollout_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        try:
            while pending:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, pending = concurrent.futures.wait(pending, timeout, concurrent.futures.FIRST_COMPLETED)
                if not done:
                    raise TimeoutError
                for future in done:
                    yield future.result()
        finally:
            for future in pending:
                future.cancel()

    @property
    def engine_lock(self) -> EngineGate:
        return self.shared.engine_lock

    # ----- rollout ---------------------------------------------------------------
    def _play(self, specs: Sequence[EnvSpec], config: LoopConfig, progress: RolloutProgress | None,
              enough: int | None = None) -> RolloutResult:
        """``progress``: told how far the rollout has got (the caller closes it)."""
        t_start = time.perf_counter()
        t_start_mono = time.monotonic()
        stats_before = self.shared.stats.snapshot()
        self._check_picklable(specs)
        groups = groups_of(specs)
        workers, depth, choice = self.n_workers, self.pipeline_depth, None
        if self._auto is not None:
            choice = self._auto.choice
            workers, depth = choice.workers, choice.depth or depth
        agents = self._agent_model_for(specs)
        with self._lease() as lease:
            played = self._run_parallel(lease, groups, config, progress, workers, depth, enough, agents)
            results, failures, retried = self._retry_crashed(lease, groups, config, progress, workers, depth, agents,
                                                             *played)
            fallback_s = self._fall_back(lease, groups, results, failures, config, progress, agents)
        t_merge = time.perf_counter()
        trajectories = sorted((t for r in results for t in r.trajectories), key=lambda t: t.env_id)
        _check_complete(specs, trajectories)
        if progress is not None:
            progress.complete()
        metrics = self._metrics(trajectories, results, stats_before, failures, time.perf_counter() - t_start)
        metrics["parallel/retried_tasks"] = float(retried)
        metrics["timing/fallback_s"] = fallback_s
        self._learn_from(results, metrics, choice, t_start_mono)
        metrics["overhead/merge_s"] = time.perf_counter() - t_merge
        metrics["timing/rollout_s"] = time.perf_counter() - t_start
        return RolloutResult(trajectories=trajectories, specs=sorted(specs, key=lambda s: s.env_id), metrics=metrics)

    def _retry_crashed(self, lease: ExecutorLease, groups: list[list[EnvSpec]], config: LoopConfig,
                       progress: RolloutProgress | None, workers: int, depth: int, agents: AgentModel | None,
                       results: list[WorkerResult],
                       failures: dict[Any, str], crashed: dict[int, str],
                       timed_out: bool) -> tuple[list[WorkerResult], dict[Any, str], int]:
        """A dead worker takes the executor down with the groups in flight on the other
        workers, which did nothing wrong: all get one parallel retry on a fresh executor;
        what fails again is left to the sequential fallback. -> (results, failures, tasks
        retried)."""
        missing = _missing(groups, results)
        if not (crashed and missing and self.settings.fallback_to_sequential and not timed_out):
            failures.update(crashed)
            return results, failures, 0
        logger.warning("[Retry] a worker died (%s); re-running the %d groups not played (its own and "
                       "the other workers' unfinished ones) in parallel", next(iter(crashed.values())),
                       len(missing))
        again, failed, crashed_again, _ = self._run_parallel(lease, missing, config, progress, workers, depth,
                                                             agents=agents)
        failures.update({f"retry {k}": v for k, v in {**failed, **crashed_again}.items()})
        return results + again, failures, len(crashed)

    def _fall_back(self, lease: ExecutorLease, groups: list[list[EnvSpec]], results: list[WorkerResult],
                   failures: dict[Any, str], config: LoopConfig, progress: RolloutProgress | None,
                   agents: AgentModel | None = None) -> float:
        """The groups no worker brought back re-run by the fallback (added to ``results``),
        or ``RolloutError`` when it is off; the seconds it took."""
        missing = _missing(groups, results)
        if not missing:
            return 0.0
        if not failures:  # a cluster re-ran a lost worker's task, which found its groups taken
            failures["lost"] = "a worker was lost; the cluster ran its task again, but its groups were taken"
        causes = "; ".join(f"worker {i}: {c}" for i, c in sorted(failures.items(), key=str))
        if not self.settings.fallback_to_sequential:
            raise RolloutError(f"{sum(map(len, missing))} envs were not played ({causes})")
        t0 = time.perf_counter()
        rest = [s for g in missing for s in g]
        ids = [s.env_id for s in rest]
        logger.warning("[Fallback] %d envs (%d groups, env_id %d..%d) were not played (%s); re-running "
                       "them sequentially with the same seeds", len(ids), len(missing), min(ids), max(ids), causes)
        result = replace(self._fallback(lease, -1, rest, config, agents), cause=causes)
        results.append(result)
        if progress is not None:  # the fallback's client reports to no rollout
            progress.envs_finished(len(result.trajectories))
            progress.answered(result.stats.requests)
        return time.perf_counter() - t0

    def _learn_from(self, results: list[WorkerResult], metrics: dict[str, float], choice: Any,
                    t_start_mono: float) -> None:
        """What the workers measured: the dispatch and engine-idle metrics, the automatic
        sizing's next choice, and the cost of a group for the next chunk sizes."""
        workers_ran = [r for r in results if r.pid != -1]
        if workers_ran and self._cluster is None:  # monotonic clocks compare on one machine only
            metrics["overhead/dispatch_s"] = max(0.0, max(r.started_at for r in workers_ran) - t_start_mono)
        metrics.update(engine_idle(self.shared.stats.call_spans, t_start_mono, time.monotonic()))
        if choice is not None:
            metrics.update(choice.metrics())
            self._auto.update(Measured(engine_s=metrics["timing/engine_s"], ipc_s=metrics["overhead/ipc_s"],
                                       busy_s=sum(max(0.0, r.wall_s - r.stats.wait_s) for r in workers_ran),
                                       workers=max(1, len(workers_ran))))
        # the chunks are of env groups: an agent episode's time is not theirs
        self._group_s = group_cost_s([t for r in workers_ran for t in r.trajectories if t.program is None]) \
            or self._group_s

    def _check_picklable(self, specs: Sequence[EnvSpec]) -> None:
        """Env configs travel to worker processes: say which key cannot, once
        per config, instead of joblib's anonymous pickling error."""
        if self.settings.backend in IN_PROCESS_BACKENDS:
            return
        from ragen.pickling import describe_unpicklable

        for spec in specs:
            if spec.reuse_key in self._picklable:
                continue
            problem = describe_unpicklable(spec.env_config, f"custom_envs.{spec.tag}.env_config")
            if problem:
                raise RolloutError(
                    f"{problem}: env configs travel to worker processes in every EnvSpec; use plain data, "
                    "build locks, clients and callables inside the env, or set agent_proxy.parallel_backend=threading"
                )
            self._picklable.add(spec.reuse_key)

    def _run_parallel(self, lease: ExecutorLease, groups: list[list[EnvSpec]], config: LoopConfig,
                      progress: RolloutProgress | None, workers: int, depth: int, enough: int | None = None,
                      agents: AgentModel | None = None):
        """The groups played by ``workers`` workers, each taking chunks of the env groups from
        the rollout's queue as it frees up, and playing its share of the agent groups (dealt
        round-robin, at most ``agent.max_concurrent`` episodes at once over all workers) on a
        gateway of its own beside them (with ``enough``, until that many groups ended
        whole: the workers tell the driver each one, and the manager answers the rest
        ``aborted``) -> (results of the workers that
        returned, failed: worker -> cause for those that returned an error,
        crashed: worker -> cause for those the executor lost, whether the
        rollout ran past rollout_timeout_s)."""
        results: list[WorkerResult] = []
        failed: dict[int, str] = {}
        crashed: dict[int, str] = {}
        agent_groups = [g for g in groups if g[0].is_agent]
        groups = [g for g in groups if not g[0].is_agent]
        max_groups, max_live = self._env_limits(groups)
        n_tasks = min(workers, len(groups) + len(agent_groups))
        queue = GroupQueue(len(groups), n_tasks, depth, max_groups, min_chunk_groups(self._group_s))
        # The manager waits for the streams (chunks) not taken yet, within its budget.
        # The workers of a cluster (dask, ray) are shared by rollouts at once: the
        # workers of a rollout that finds another on it start only as that one's
        # end, and waiting for them held every engine call to its full budget: not
        # announced then.
        with self._lock:
            alone = self._cluster is None or self._rollouts_running == 0
            self._rollouts_running += 1
        with announced(self.shared, len(queue) if alone else 0, queue, progress, enough) as tag:
            client = replace(self._client, tag=tag)
            # Workers isolate env errors: a failing env is retried alone and, if it
            # keeps failing, ends its own trajectory; its worker goes on.
            concurrency = -(-config.agent_max_concurrent // n_tasks)
            calls = [WorkerTask(i, [s for g in agent_groups[i::n_tasks] for s in g], client, config,
                                isolate_errors=True, groups=groups, max_live_envs=max_live, pipeline_depth=depth,
                                report_groups=enough is not None, agent_model=agents,
                                agent_concurrency=concurrency)
                     for i in range(n_tasks)]
            try:
                for res in self._results(lease, calls):
                    if res.error:
                        failed[res.task] = res.error
                    else:
                        results.append(res)
            except Exception as exc:  # a dead worker, a timeout: the executor is gone
                if isinstance(exc, TimeoutError):
                    cause = f"no result within agent_proxy.rollout_timeout_s={self.settings.rollout_timeout_s} s"
                else:  # its first line: loky adds a paragraph on what may kill a worker
                    lines = str(exc).strip().splitlines()
                    cause = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
                lease.workers.replace()
                done = {r.task for r in results}
                crashed = {i: cause for i in range(n_tasks) if i not in done and i not in failed}
                return results, failed, crashed, isinstance(exc, TimeoutError)
            finally:
                with self._lock:
                    self._rollouts_running -= 1
        return results, failed, crashed, False

    def _env_limits(self, groups: list[list[EnvSpec]]) -> tuple[int | None, int | None]:
        """The most groups in a chunk and envs live in a worker at once, where
        ``max_env_num_per_worker`` bounds what a worker holds (None: no bound)."""
        cap = self.settings.max_env_num_per_worker
        if not cap or not groups:
            return None, None
        per_group = max(len(g) for g in groups)
        max_groups = max(1, cap // per_group)
        return max_groups, max(1, cap - max_groups * per_group + 1)

    def _fallback(self, lease: ExecutorLease, task: int, specs: list[EnvSpec],
                  config: LoopConfig, agents: AgentModel | None = None) -> WorkerResult:
        limit_s = self.settings.fallback_env_timeout_s
        if self.settings.backend in IN_PROCESS_BACKENDS:
            # The task ran in this process: its env configs need not pickle and envs
            # registered here (register_env) are known only here; an env that can kill
            # its process would have done so already. Env calls are bounded by
            # env_timeout_s (or fallback_env_timeout_s), each engine wait by engine_timeout_s.
            # A fresh connection: the failure may have left this thread's out of step.
            self._client.reset()
            result = run_worker(WorkerTask(task, specs, self._client, with_env_limit(config, limit_s),
                                           isolate_errors=True, agent_model=agents,
                                           agent_concurrency=config.agent_max_concurrent))
        else:
            result = run_isolated(lease.spare, task, specs, self._client, config, limit_s, agents)
        if result.error:  # not an env's failure (the engine, the manager): nothing to isolate
            raise RolloutError(f"worker task {task} failed again in the fallback: {result.error}")
        return result

    def _metrics(self, trajectories, results, before, failures, wall_s: float) -> dict[str, float]:
        after = self.shared.stats.snapshot()  # one consistent reading while the batcher goes on
        calls = after.engine_calls - before.engine_calls
        engine = EngineUse(calls=calls, requests=after.requests - before.requests,
                           time_s=after.engine_time_s - before.engine_time_s,
                           batch_sizes=list(after.batch_sizes)[-calls:] if calls else ())
        m = rollout_metrics(trajectories, sum((r.stats for r in results), LoopStats()), engine,
                            fallbacks=len(failures), wall_s=wall_s)
        m.update({
            # what parallel rollout itself costs (the overhead preset): besides dispatch and merge
            # (set in _play), the engine held for more requests, and a worker's messages in transit
            "overhead/coalesce_wait_s": after.coalesce_wait_s - before.coalesce_wait_s,
            "overhead/ipc_s": _mean([r.ipc_s for r in results if r.pid != -1]),
            # streams open as an engine call started (with agent calls only: the calls in flight)
            "engine/mean_open_streams": (after.streams_at_calls - before.streams_at_calls)
            / max(1, after.calls_started - before.calls_started),
            "ipc/bytes_in": float(after.bytes_in - before.bytes_in),
            "ipc/bytes_out": float(after.bytes_out - before.bytes_out),
            "ipc/messages": float(after.messages_in - before.messages_in),
            "parallel/tasks": float(sum(r.pid != -1 for r in results)),
            "parallel/chunks": float(sum(r.stats.chunks for r in results)),
            "parallel/envs_created": float(sum(r.stats.envs_created for r in results)),
            "parallel/workers_used": float(len({r.pid for r in results if r.trajectories and r.pid != -1})),
        })
        for r in results:
            if r.pid != -1:
                m[f"worker/task{r.task}_wall_s"] = r.wall_s
        return m

    def close(self) -> None:
        """Stops every executor; a rollout still running on another thread fails."""
        with self._lock:
            self._closed = True
            leases = self._idle + list(self._leased)
            self._idle, self._leased = [], set()
        for lease in leases:
            lease.close()
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None
        self._close_owned()

    def __enter__(self) -> "ParallelRolloutManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _missing(groups: list[list[EnvSpec]], results: list[WorkerResult]) -> list[list[EnvSpec]]:
    """The groups none of ``results`` played (a worker's groups come back together or not at all)."""
    played = {t.env_id for r in results for t in r.trajectories}
    return [g for g in groups if g[0].env_id not in played]


def _check_complete(specs: Sequence[EnvSpec], trajectories: Sequence[Trajectory]) -> None:
    want = sorted(s.env_id for s in specs)
    got = [t.env_id for t in trajectories]
    if want != got:
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        raise RolloutError(f"rollout lost or duplicated trajectories: missing env_ids {missing}, extra {extra}")
