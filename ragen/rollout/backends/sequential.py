"""The sequential backend: RAGEN's loop in the calling thread, one engine call a turn over all active envs."""

from __future__ import annotations

import time
from typing import Sequence

from ragen.llm.types import Engine
from ragen.rollout.backends.base import SyncBackend
from ragen.rollout.env_calls import KeptEnvs
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.scheduler import GroupCount, run_envs
from ragen.rollout.metrics import EngineUse, rollout_metrics
from ragen.rollout.progress import RolloutProgress
from ragen.rollout.types import EnvSpec, RolloutResult
from ragen.serving import DirectClient, StreamingDirectClient
from ragen.serving.gate import EngineGate


class SequentialRollout(SyncBackend):
    """``use_parallel_rollout: false``: the reference loop, and the one to debug
    with. Envs are kept between rollouts; an env that fails ends its own
    trajectory in ``error`` or ``timeout``, the others go on."""

    def __init__(self, engine: Engine, engine_lock: EngineGate | None = None,
                 max_concurrent_rollouts: int | None = None) -> None:
        super().__init__(max_concurrent_rollouts)
        self.engine = engine
        self._lock = engine_lock or EngineGate()
        self._kept_envs = KeptEnvs()

    @property
    def engine_lock(self) -> EngineGate:
        return self._lock

    def _play(self, specs: Sequence[EnvSpec], loop: LoopConfig, progress: RolloutProgress,
              enough: int | None = None) -> RolloutResult:
        t0 = time.perf_counter()
        client: _LockedClient | _StreamingClient = (_StreamingClient if self.engine.streams else _LockedClient)(
            self.engine, self._lock, progress)
        # one stream: one engine call per turn over all active envs; env-level turns on an engine that
        # streams (agent_proxy.env_level_async)
        trajectories, stats = run_envs(specs, client, loop, kept_envs=self._kept_envs, isolate_errors=True,
                                       on_finished=progress.envs_finished,
                                       groups_done=None if enough is None else GroupCount(enough).add)
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

    def __init__(self, engine: Engine, lock: EngineGate, progress: RolloutProgress) -> None:
        super().__init__(engine)
        self._engine_lock = lock
        self._progress = progress

    def wait_any(self, timeout: float | None = None):
        if self._queue:
            self._progress.engine_batch(len(self._queue[0][1]))  # the call about to run
        with self._engine_lock:
            ticket, completions = super().wait_any()
        self._progress.answered(len(completions))
        return ticket, completions


class _StreamingClient(StreamingDirectClient):
    """The sequential rollout's client of an engine that streams: each request
    holds the engine gate shared until answered, and answers are told to the
    rollout's progress."""

    def __init__(self, engine: Engine, gate: EngineGate, progress: RolloutProgress) -> None:
        super().__init__(engine, gate)
        self._progress = progress

    def wait_any(self, timeout: float | None = None):
        got = super().wait_any(timeout)
        if got is not None:
            self._progress.answered(len(got[1]))
        return got
