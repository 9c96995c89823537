"""RAGEN's module path for the rollout entry point: ``ragen.rollout.proxy``."""

from ragen.rollout.proxy import AgentSetup, LLMAgentProxy

__all__ = ["AgentSetup", "LLMAgentProxy"]
