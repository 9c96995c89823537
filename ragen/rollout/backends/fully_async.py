"""``rollout_mode: fully_async``: env groups kept in flight on workers across
training steps; the trainer takes completed groups as they come.

- ``FullyAsync``: the backend; a batch of the train env set is its
  ``env_groups`` lowest-numbered completed groups; a list of specs
  (validation) is played by the synchronous backend it holds.
- ``GroupsInFlight``: the scheduler that keeps the groups in flight, as its
  ``FullyAsyncSettings`` say.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ragen.rollout.backends.ahead import StalenessBound, response_tokens
from ragen.rollout.backends.base import AsyncBackend, SyncBackend
from ragen.rollout.config import AgentProxyConfig, cap_n_jobs
from ragen.rollout.envs import EnvSpecMaker, compute_metrics
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.progress import RolloutProgress
from ragen.rollout.types import RolloutResult
from ragen.rollout.workers.executors import KeptExecutor, local_pool
from ragen.rollout.workers.task import WorkerTask, run_worker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FullyAsyncSettings:
    """The settings of ``FullyAsync`` and its ``GroupsInFlight``: how many groups fly at once,
    on which workers, how often one may restart, how many policy versions a group may lag
    (``max_version_span``: the staleness bound, and without ``partial_rollout`` the versions a
    group's turns may span), and how long a worker waits for an answer; ``of`` cuts them from
    the ``agent_proxy`` section."""

    max_inflight_groups: int = 8
    n_jobs: Any = -1
    backend: str = "loky"
    max_restarts: int = 3
    max_version_span: int = 1
    partial_rollout: bool = True
    engine_timeout_s: float | None = None

    @classmethod
    def of(cls, ap: AgentProxyConfig) -> "FullyAsyncSettings":
        return cls(max_inflight_groups=ap.max_inflight_groups,
                   n_jobs=-1 if ap.parallel_n_jobs == "auto" else ap.parallel_n_jobs, backend=ap.parallel_backend,
                   max_version_span=ap.plan.bound, partial_rollout=ap.partial_rollout,
                   engine_timeout_s=ap.engine_timeout_s)


class GroupsInFlight:
    """``rollout_mode: fully_async``: env groups generating at all times.

    A scheduler thread in the driver keeps up to ``max_inflight_groups`` groups
    in flight on worker processes (loky; ``threading`` for debugging), one task
    per group, across step boundaries: the next step does not wait for the
    slowest group of this one. Groups are numbered in the order they are drawn
    from the train env set (seeds as the synchronous rollouts would use them).

    - ``get_batch(n)``: the ``n`` lowest-numbered completed groups, sorted by
      number; the others stay queued for the next call.
    - *Admission*: a new group starts only while fewer than ``ahead_groups``
      groups are drawn and not yet handed out (``bound`` batches: a group
      drawn while the trainer trains on version v is, taken in order, trained
      on at version v + bound at the latest, so its first turn is at most
      ``bound`` versions old; a straggler taken after its turn can be older,
      and training logs its lag). Generation never runs further ahead of the
      trainer than that, so it neither queues without limit nor makes groups
      only to drop them as stale.
    - *Weight updates mid-group*: with ``partial_rollout`` a group goes on with
      the new weights from its next turn; each turn keeps the version that
      answered it (and its log-probs, which the trainer corrects with).
      Without it, a group whose turns span more than ``max_version_span``
      versions is restarted from its first turn (the bound is ``max(1,
      async_generation_ratio)``: restarting on every update would never
      finish groups longer than a training step).
    - A group whose worker failed is put back and restarted from its start:
      never lost, never returned half-done.
    - ``counts``: groups started, completed, restarted, handed out; response
      tokens generated, and those thrown away by restarts.
    - ``close()`` stops the scheduler and the worker processes.
    """

    def __init__(self, es, client, config, flight: FullyAsyncSettings = FullyAsyncSettings(),
                 ahead_groups: int | None = None) -> None:
        import joblib

        self.es, self.client, self.config, self.flight = es, client, config, flight
        self.ahead_groups = ahead_groups  # None: no admission bound
        # One task is one group, and a group mostly waits for the engine: a worker per
        # in-flight group (not per core) keeps max_inflight_groups really in flight, up to
        # the workers a machine takes (past them, groups wait for a worker).
        self._n_workers = max(joblib.effective_n_jobs(cap_n_jobs(flight.n_jobs)),
                              cap_n_jobs(flight.max_inflight_groups, key="agent_proxy.max_inflight_groups"))
        self._workers = KeptExecutor(lambda: local_pool(flight.backend, self._n_workers, "ragen-async"))
        self._workers.get()
        self._cond = threading.Condition()
        self._completed: dict[int, list] = {}
        self._restart: list[int] = []
        self._attempts: dict[int, int] = {}
        self._next_group = 0
        self._stop = False
        self._error: BaseException | None = None
        self.counts = {"started": 0, "completed": 0, "restarted": 0, "handed_out": 0,
                       "tokens_generated": 0, "tokens_restarted": 0}
        self._thread = threading.Thread(target=self._schedule, name="ragen-fully-async", daemon=True)
        self._thread.start()

    def _schedule(self) -> None:
        from concurrent.futures import FIRST_COMPLETED, BrokenExecutor, wait

        inflight: dict = {}
        try:
            while True:
                with self._cond:
                    if self._stop:
                        break
                    while len(inflight) < self.flight.max_inflight_groups:
                        if self._restart:
                            index = self._restart.pop(0)
                        elif self._admits():
                            index = self._next_group
                            self._next_group += 1
                        else:  # far enough ahead of the trainer: wait for it to take a batch
                            break
                        specs = self.es.group_specs(index)
                        executor = self._workers.get()
                        future = executor.submit(run_worker, WorkerTask(index, specs, self.client, self.config))
                        inflight[future] = (index, executor)
                        self.counts["started"] += 1
                    if not inflight:  # nothing to wait for until the trainer takes a batch (get_batch notifies)
                        self._cond.wait(timeout=0.1)
                        continue
                done, _ = wait(list(inflight), timeout=0.1, return_when=FIRST_COMPLETED)
                for future in done:
                    index, executor = inflight.pop(future)
                    try:
                        result = future.result()
                        failure = result.error
                    except Exception as exc:  # a lost worker, whatever killed it: the group restarts
                        result, failure = None, f"{type(exc).__name__}: {exc}"
                        if isinstance(exc, BrokenExecutor):  # a worker died and took its executor down
                            self._workers.replace(failed=executor)
                    trajectories = result.trajectories if result else []
                    versions = {t.policy_version for tr in trajectories for t in tr.turns}
                    if (not self.flight.partial_rollout and failure is None and versions
                            and max(versions) - min(versions) > self.flight.max_version_span):
                        failure = f"weight updates landed mid-group (versions {sorted(versions)})"
                    tokens = response_tokens(trajectories)
                    with self._cond:
                        self.counts["tokens_generated"] += tokens
                        if failure is None:
                            self._completed[index] = result.trajectories
                            self.counts["completed"] += 1
                        else:
                            self._attempts[index] = self._attempts.get(index, 0) + 1
                            if self._attempts[index] > self.flight.max_restarts:
                                raise RuntimeError(f"group {index} failed {self._attempts[index]} times: {failure}")
                            logger.info("group %d restarts from its start: %s", index, failure)
                            self._restart.append(index)
                            self.counts["restarted"] += 1
                            self.counts["tokens_restarted"] += tokens
                        self._cond.notify_all()
        except BaseException as exc:  # whatever stopped it reaches the trainer's next get_batch
            logger.exception("the fully-async scheduler stopped")
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _admits(self) -> bool:
        """Whether a new group may start: the groups drawn and not handed out are under the bound."""
        return self.ahead_groups is None or self._next_group - self.counts["handed_out"] < self.ahead_groups

    def get_batch(self, n: int, timeout: float | None = None) -> list[tuple[int, list]]:
        """``n`` completed groups ``(index, trajectories)``, lowest index first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._completed) < n:
                if self._error is not None:
                    raise RuntimeError(f"fully-async rollout failed: {self._error}") from self._error
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"only {len(self._completed)} of {n} groups completed in time")
                self._cond.wait(remaining if remaining is not None else 1.0)
            indexes = sorted(self._completed)[:n]
            self.counts["handed_out"] += n
            self._cond.notify_all()  # the scheduler may admit new groups now
            return [(i, self._completed.pop(i)) for i in indexes]

    def queued(self) -> int:
        with self._cond:
            return len(self._completed)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        self._workers.close(wait=True)


class FullyAsync(AsyncBackend):
    """``rollout_mode: fully_async``: a batch of the train env set is the
    ``env_groups`` lowest-numbered groups completed by ``GroupsInFlight``,
    each trained on whole (a partial group's turns carry their versions); a
    group restarted from its start that is more than ``bound`` versions old
    is dropped. Lists of specs are played by ``inner``."""

    def __init__(self, inner: SyncBackend, settings: FullyAsyncSettings = FullyAsyncSettings()) -> None:
        super().__init__(inner)
        self.bound = StalenessBound(settings.max_version_span)
        self._flight = settings
        self._groups: GroupsInFlight | None = None
        inner.keeps_episodes = True  # the groups in flight run episodes between rollouts

    def _next_batch(self, envs: EnvSpecMaker, loop: LoopConfig, policy_version: int,
                    progress: RolloutProgress | None) -> RolloutResult:
        if self._groups is None:
            # `bound` batches drawn ahead of the trainer: a group drawn while it trains on version v
            # is taken, in order, at version v + bound at the latest
            self._groups = GroupsInFlight(envs, self.serving.client(timeout_s=self._flight.engine_timeout_s), loop,
                                          self._flight, ahead_groups=self.bound.bound * envs.env_groups)
        t0 = time.perf_counter()
        groups = []
        # envs of the groups taken for this batch, as they come (no turns: the groups in flight
        # belong to no one batch)
        with progress if progress is not None else RolloutProgress(envs.num_envs, "train (fully async)") as shown:
            while len(groups) < envs.env_groups:
                for index, trajs in self._groups.get_batch(envs.env_groups - len(groups)):
                    # a restarting group older than the bound is dropped; a partial one is trained on whole
                    if self.bound.admit(trajs, policy_version, drop=not self._flight.partial_rollout):
                        groups.append((index, trajs))
                        shown.envs_finished(len(trajs))
        groups.sort(key=lambda g: g[0])
        trajectories = [t for _, trajs in groups for t in trajs]
        specs = [s for index, _ in groups for s in envs.group_specs(index)]
        metrics = compute_metrics(trajectories)  # the engine's and envs' time belong to no one batch
        metrics["timing/rollout_s"] = time.perf_counter() - t0
        return RolloutResult(trajectories=trajectories, specs=specs, metrics=metrics)

    def metrics(self) -> dict[str, float]:
        if self._groups is None:
            return {}
        m = {f"async/{k}" if k.startswith("tokens") else f"async/groups_{k}": float(v)
             for k, v in self._groups.counts.items()}
        m.update(self.bound.metrics())
        m["async/queued_groups"] = float(self._groups.queued())
        return m

    def close(self) -> None:
        if self._groups is not None:
            self._groups.close()
        super().close()
