"""RAGEN's names for the rollout (``ragen.rollout``) and the shared engine (``ragen.serving``).

``LLMAgentProxy``, ``EnvStateManager`` and ``ContextManager`` keep RAGEN's module
paths too (``ragen.llm_agent.agent_proxy``, ``.es_manager``, ``.ctx_manager``)."""

from ragen.rollout.proxy import AgentSetup, LLMAgentProxy
from ragen.rollout.context import ContextConfig, ContextManager
from ragen.rollout.env_state import EnvStateManager
from ragen.rollout.envs import compute_metrics
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings, RolloutError
from ragen.rollout.env_calls import KeptEnvs
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.scheduler import run_envs
from ragen.serving import DirectClient, SharedLLMClient, SharedLLMInferenceManager
from ragen.rollout.types import EnvSpec, RolloutResult, StopReason, Trajectory, Turn

__all__ = [
    "AgentSetup", "LLMAgentProxy", "ContextConfig", "ContextManager", "EnvStateManager", "compute_metrics",
    "ParallelRolloutManager", "ParallelSettings", "RolloutError", "DirectClient", "KeptEnvs", "LoopConfig", "run_envs",
    "SharedLLMClient", "SharedLLMInferenceManager", "EnvSpec", "RolloutResult", "StopReason", "Trajectory", "Turn",
]
