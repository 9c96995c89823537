"""The sequential backend: RAGEN's loop in the calling thread, one engine call a turn over all active envs."""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

from ragen.llm.types import Engine
from ragen.rollout.backends.base import SyncBackend
from ragen.rollout.loop import KeptEnvs, LoopConfig, run_envs
from ragen.rollout.metrics import EngineUse, rollout_metrics
from ragen.rollout.progress import RolloutProgress
from ragen.rollout.types import EnvSpec, RolloutResult
from ragen.serving import DirectClient


class SequentialRollout(SyncBackend):
    """``use_parallel_rollout: false``: the reference loop, and the one to debug
    with. Envs are kept between rollouts; an env that fails ends its own
    trajectory in ``error`` or ``timeout``, the others go on."""

    def __init__(self, engine: Engine, engine_lock: threading.Lock | None = None,
                 max_concurrent_rollouts: int | None = None) -> None:
        super().__init__(max_concurrent_rollouts)
        self.engine = engine
        self._lock = engine_lock or threading.Lock()
        self._kept_envs = KeptEnvs()

    @property
    def engine_lock(self) -> threading.Lock:
        return self._lock

    def _play(self, specs: Sequence[EnvSpec], loop: LoopConfig, progress: RolloutProgress,
              fault: dict[str, Any] | None) -> RolloutResult:
        if fault is not None:
            raise ValueError("fault injection kills a worker process: it needs use_parallel_rollout: true")
        t0 = time.perf_counter()
        client = _LockedClient(self.engine, self._lock, progress)
        # one stream: one engine call per turn over all active envs
        trajectories, stats = run_envs(specs, client, loop, kept_envs=self._kept_envs, isolate_errors=True,
                                       on_finished=progress.envs_finished)
        engine = EngineUse(calls=client.engine_calls, requests=sum(client.batch_sizes),
                           time_s=client.engine_time_s, batch_sizes=client.batch_sizes)
        metrics = rollout_metrics(trajectories, stats, engine, fallbacks=0, wall_s=time.perf_counter() - t0)
        return RolloutResult(trajectories=trajectories, specs=list(specs), metrics=metrics)

    def close(self) -> None:
        self._kept_envs.close()
        self._close_owned()


class _LockedClient(DirectClient):
    """The sequential rollout's client: engine calls under the engine lock,
    each one told to the rollout's progress."""

    def __init__(self, engine: Engine, lock: threading.Lock, progress: RolloutProgress) -> None:
        super().__init__(engine)
        self._engine_lock = lock
        self._progress = progress

    def wait_any(self):
        if self._queue:
            self._progress.engine_batch(len(self._queue[0][1]))  # the call about to run
        with self._engine_lock:
            ticket, completions = super().wait_any()
        self._progress.answered(len(completions))
        return ticket, completions
