"""The rollout backends, siblings behind ``RolloutBackend``, and ``make_backend``, which picks one from
the config's ``RolloutPlan`` and builds it with its frozen settings (``SequentialSettings``,
``ParallelSettings``, ``FullyAsyncSettings``, each cut from the ``agent_proxy`` section by ``of``)
and its serving (``make_serving``: the shared manager the config describes, which the gateway's
command line serves too).

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
from ragen.rollout.backends.fully_async import FullyAsync, FullyAsyncSettings
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings, RolloutError
from ragen.rollout.backends.sequential import SequentialRollout, SequentialSettings
from ragen.rollout.config import AgentProxyConfig, LlmServerConfig, env_level_for
from ragen.rollout.workers.cluster import ClusterConfig
from ragen.serving import SharedLLMInferenceManager
from ragen.utils import closed_on_failure

__all__ = ["FullyAsync", "FullyAsyncSettings", "GenerateAhead", "ParallelRolloutManager", "ParallelSettings",
           "RolloutBackend", "RolloutError", "SequentialRollout", "SequentialSettings", "SyncBackend", "make_backend",
           "make_serving"]


def make_serving(ap: AgentProxyConfig, engine: Engine,
                 server: LlmServerConfig = LlmServerConfig()) -> SharedLLMInferenceManager:
    """The ``SharedLLMInferenceManager`` of ``engine`` as the config sets it: its batches and
    wait (``agent_proxy``), its address (``llm_server``). The caller closes it."""
    return SharedLLMInferenceManager(
        engine, max_batch_size=ap.max_batch_size, coalesce_wait_s=ap.coalesce_wait_s,
        host=server.host, port=server.port, max_message_bytes=ap.max_message_bytes,
        request_timeout_s=ap.engine_timeout_s)


def make_backend(ap: AgentProxyConfig, engine: Engine, server: LlmServerConfig = LlmServerConfig(),
                 cluster: ClusterConfig = ClusterConfig()) -> RolloutBackend:
    """The backend of the ``agent_proxy`` section's plan (``AgentProxyConfig.plan``), around
    ``engine``. Where episodes ask a shared manager (workers, groups in flight), it is built
    here and handed to the backend, whose ``close()`` stops it."""
    env_level_for(ap.env_level_async, engine.streams, engine.name, STREAMING_ENGINES)  # refuses true on a batch engine
    plan = ap.plan
    serving = make_serving(ap, engine, server) if plan.serves else None
    # any failure, an interrupt too: the manager it started is closed, then re-raised
    with closed_on_failure(serving.close if serving is not None else None):
        sync: SyncBackend
        if plan.workers:
            sync = ParallelRolloutManager(serving, ParallelSettings.of(ap), cluster, owns_serving=True)
        else:
            sync = SequentialRollout(engine, SequentialSettings.of(ap), serving, owns_serving=True)
        if plan.ahead == "groups":
            return FullyAsync(sync, FullyAsyncSettings.of(ap))
        if plan.ahead == "batches":
            return GenerateAhead(sync, plan.bound)
        return sync
