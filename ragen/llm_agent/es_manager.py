"""RAGEN's module path for the env state manager: ``ragen.rollout.envs``."""

from ragen.rollout.envs import EnvStateManager

__all__ = ["EnvStateManager"]
