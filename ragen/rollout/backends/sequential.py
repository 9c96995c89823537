"""The sequential backend: RAGEN's loop in the calling thread, one engine call a turn over all active envs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from ragen.llm.types import Engine
from ragen.rollout.agent_play import AgentModel, EngineLinkClient, agent_stats, play_agents
from ragen.rollout.backends.base import SyncBackend
from ragen.rollout.config import AgentProxyConfig
from ragen.rollout.env_calls import KeptEnvs
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.scheduler import GroupCount, run_envs
from ragen.rollout.metrics import EngineUse, rollout_metrics
from ragen.rollout.progress import RolloutProgress
from ragen.rollout.types import EnvSpec, RolloutResult, Trajectory
from ragen.serving import DirectClient, SharedLLMInferenceManager, StreamingDirectClient
from ragen.serving.gate import EngineGate


@dataclass(frozen=True)
class SequentialSettings:
    """What a ``SequentialRollout`` is built with: the ``agent_proxy`` keys of its name (``of``)."""

    max_concurrent_rollouts: int | None = None
    engine_timeout_s: float | None = None  # bounds the engine gate's wait for streamed requests

    @classmethod
    def of(cls, ap: AgentProxyConfig) -> "SequentialSettings":
        return cls(max_concurrent_rollouts=ap.max_concurrent_rollouts, engine_timeout_s=ap.engine_timeout_s)


class SequentialRollout(SyncBackend):
    """``use_parallel_rollout: false``: the reference loop, and the one to debug
    with. Envs are kept between rollouts; an env that fails ends its own
    trajectory in ``error`` or ``timeout``, the others go on. With ``serving``
    (the shared manager of groups in flight), its engine calls share that
    manager's engine lock."""

    def __init__(self, engine: Engine, settings: SequentialSettings = SequentialSettings(),
                 serving: SharedLLMInferenceManager | None = None, *, owns_serving: bool = False) -> None:
        super().__init__(settings.max_concurrent_rollouts, serving, owns_serving)
        self.engine = engine
        self._lock = serving.engine_lock if serving is not None else EngineGate.for_requests(settings.engine_timeout_s)
        self._kept_envs = KeptEnvs()
        self._agent_model: AgentModel | None = None  # read from the engine at the first agent episode

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
        trajectories, stats = run_envs([s for s in specs if not s.is_agent], client, loop, kept_envs=self._kept_envs,
                                       isolate_errors=True, on_finished=progress.envs_finished,
                                       groups_done=None if enough is None else GroupCount(enough).add)
        agents = EngineLinkClient(self.engine, self._lock, progress)
        if any(s.is_agent for s in specs):
            played = self._play_agents([s for s in specs if s.is_agent], loop, agents, progress)
            stats = stats + agent_stats(played)
            by_id = {t.env_id: t for t in trajectories + played}
            trajectories = [by_id[s.env_id] for s in specs]
        sizes = client.batch_sizes + agents.batch_sizes
        engine = EngineUse(calls=client.engine_calls + agents.engine_calls, requests=sum(sizes),
                           time_s=client.engine_time_s + agents.engine_time_s, batch_sizes=sizes)
        metrics = rollout_metrics(trajectories, stats, engine, fallbacks=0, wall_s=time.perf_counter() - t0)
        return RolloutResult(trajectories=trajectories, specs=list(specs), metrics=metrics)

    def _play_agents(self, specs: list[EnvSpec], loop: LoopConfig, client: EngineLinkClient,
                     progress: RolloutProgress) -> list[Trajectory]:
        """The agent episodes, one after another, on a gateway whose calls run on the engine here."""
        if self._agent_model is None:
            self._agent_model = AgentModel.of(self.engine)
        return play_agents(specs, client, self._agent_model, loop.sampling,
                           loop.max_abs_reward, 1, loop.engine_timeout_s, lambda _t: progress.envs_finished(1))

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
