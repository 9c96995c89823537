"""``ExecutorLease``: the executors one parallel rollout holds while it runs."""

from __future__ import annotations

from typing import Any

import joblib

from ragen.rollout.workers.executors import LOCAL_POOLS, KeptExecutor, local_pool


class ExecutorLease:
    """The executors of one rollout at a time: the workers' (a ``joblib.Parallel``
    or a ``concurrent.futures`` executor) and the fallback's spare process.

    Rollouts at once (``max_concurrent_rollouts`` > 1) each lease their own: a
    ``joblib.Parallel`` is not reentrant (two calls at once share its task
    queue and backend state: one call never returned, or its backend was torn
    down under the other), and a failure that takes an executor down (a
    killed worker, a timeout, an env that kills the spare process) must not
    take another rollout's healthy tasks with it.
    """

    def __init__(self, manager: Any) -> None:  # the ParallelRolloutManager (its settings)
        self.manager = manager
        self.workers = KeptExecutor(self._build_workers)
        self.spare = KeptExecutor(lambda: local_pool("loky", 1, "ragen-spare"))
        self._size = 1  # workers of the local pool (LOCAL_POOLS) when it is next built

    def workers_for(self, tasks: int):
        """The workers' executor, for a rollout of ``tasks`` tasks. A local pool
        has as many workers as a rollout has had tasks (at most ``n_workers``):
        none is started for groups that do not exist. It is built again, larger,
        when a rollout has more (its workers' kept envs are lost then, once)."""
        m = self.manager
        if m.settings.backend in LOCAL_POOLS and self._size < min(tasks, m.n_workers):
            self._size = min(tasks, m.n_workers)
            self.workers.close(wait=False)
        return self.workers.get()

    def _build_workers(self):
        m = self.manager
        if m.settings.backend in LOCAL_POOLS:
            return local_pool(m.settings.backend, self._size, "ragen-worker")
        parallel = joblib.Parallel(
            n_jobs=1 if m.settings.backend == "sequential" else (-1 if m._auto is not None else m.n_jobs),
            backend=m._joblib_backend(), batch_size=1,
            # results as tasks finish, so a failure keeps the finished ones; the
            # ray backend returns all at once
            return_as="list" if m.settings.backend == "ray" else "generator_unordered",
            pre_dispatch="all", timeout=m.settings.rollout_timeout_s,
        )
        parallel.__enter__()
        return parallel

    def close(self) -> None:
        self.workers.close(wait=False)
        self.spare.close(wait=True)
