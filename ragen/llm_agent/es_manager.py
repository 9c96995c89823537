"""RAGEN's module path for the env state manager: ``ragen.rollout.env_state``."""

from ragen.rollout.env_state import EnvStateManager, EnvStatus

__all__ = ["EnvStateManager", "EnvStatus"]
