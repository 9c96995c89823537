"""The agent loop: context, env state, sequential and parallel rollout."""

from ragen.llm_agent.agent_proxy import AgentSetup, LLMAgentProxy
from ragen.llm_agent.ctx_manager import ContextConfig, ContextManager
from ragen.llm_agent.es_manager import EnvStateManager, compute_metrics
from ragen.llm_agent.parallel_rollout import ParallelRolloutManager, RolloutError
from ragen.llm_agent.rollout_loop import KeptEnvs, LoopConfig, run_envs
from ragen.llm_agent.inference import DirectClient, SharedLLMClient, SharedLLMInferenceManager
from ragen.llm_agent.types import EnvSpec, RolloutResult, StopReason, Trajectory, Turn

__all__ = [
    "AgentSetup", "LLMAgentProxy", "ContextConfig", "ContextManager", "EnvStateManager", "compute_metrics",
    "ParallelRolloutManager", "RolloutError", "DirectClient", "KeptEnvs", "LoopConfig", "run_envs",
    "SharedLLMClient", "SharedLLMInferenceManager", "EnvSpec", "RolloutResult", "StopReason", "Trajectory", "Turn",
]
