"""The rollout backends, siblings behind ``RolloutBackend``, and ``make_backend``, which picks one from the config.

- ``SequentialRollout`` (``use_parallel_rollout: false``): RAGEN's loop in
  the calling thread.
- ``ParallelRolloutManager`` (``use_parallel_rollout: true``): joblib workers
  around one shared engine.
- ``GenerateAhead`` (``async_generation_ratio: k > 0``): either of those,
  generating training batches up to ``k`` ahead of the trainer.
- ``FullyAsync`` (``rollout_mode: fully_async``): groups in flight across
  training steps.
"""

from __future__ import annotations

from ragen.llm import STREAMING_ENGINES
from ragen.llm.types import Engine
from ragen.rollout.backends.ahead import GenerateAhead
from ragen.rollout.backends.base import RolloutBackend, SyncBackend
from ragen.rollout.backends.fully_async import FullyAsync
from ragen.rollout.backends.parallel import ParallelRolloutManager, RolloutError
from ragen.rollout.backends.sequential import SequentialRollout
from ragen.rollout.config import AgentProxyConfig, LlmServerConfig, env_level_for
from ragen.rollout.workers.cluster import ClusterConfig
from ragen.serving import SharedLLMInferenceManager
from ragen.serving.gate import EngineGate
from ragen.utils import closed_on_failure

__all__ = ["FullyAsync", "GenerateAhead", "ParallelRolloutManager", "RolloutBackend", "RolloutError",
           "SequentialRollout", "SyncBackend", "make_backend"]


def make_backend(ap: AgentProxyConfig, engine: Engine, server: LlmServerConfig = LlmServerConfig(),
                 cluster: ClusterConfig = ClusterConfig()) -> RolloutBackend:
    """The backend the ``agent_proxy`` section asks for, around ``engine``.
    Its ``serving`` is the shared manager its workers talk to (parallel or
    fully-async), built here and stopped by the backend's ``close()``."""
    env_level_for(ap.env_level_async, engine.streams, engine.name, STREAMING_ENGINES)  # refuses true on a batch engine
    serving = None
    if ap.use_parallel_rollout or ap.rollout_mode == "fully_async":
        serving = SharedLLMInferenceManager(
            engine, max_batch_size=ap.max_batch_size, coalesce_wait_s=ap.coalesce_wait_s,
            host=server.host, port=server.port, max_message_bytes=ap.max_message_bytes,
            request_timeout_s=ap.engine_timeout_s)
    # any failure, an interrupt too: the manager it started is closed, then re-raised
    with closed_on_failure(serving.close if serving is not None else None):
        sync: SyncBackend
        if ap.use_parallel_rollout:
            sync = ParallelRolloutManager(
                serving, n_jobs=ap.parallel_n_jobs, backend=ap.parallel_backend,
                max_env_num_per_worker=ap.max_env_num_per_worker, fallback_to_sequential=ap.fallback_to_sequential,
                rollout_timeout_s=ap.rollout_timeout_s, engine_timeout_s=ap.engine_timeout_s, cluster=cluster,
                max_concurrent_rollouts=ap.max_concurrent_rollouts, pipeline_depth=ap.pipeline_depth)
        else:
            sync = SequentialRollout(engine, serving.engine_lock if serving is not None else
                                     EngineGate.for_requests(ap.engine_timeout_s),
                                     max_concurrent_rollouts=ap.max_concurrent_rollouts)
        sync.serving = sync.owned_serving = serving
        if ap.rollout_mode == "fully_async":
            return FullyAsync(sync, max(1, ap.async_generation_ratio),
                              max_inflight_groups=ap.max_inflight_groups,
                              n_jobs=-1 if ap.parallel_n_jobs == "auto" else ap.parallel_n_jobs,
                              backend=ap.parallel_backend,
                              partial_rollout=ap.partial_rollout, engine_timeout_s=ap.engine_timeout_s)
        if ap.async_generation_ratio > 0:
            return GenerateAhead(sync, ap.async_generation_ratio)
        return sync
