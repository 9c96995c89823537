"""RAGEN's module path for the context manager: ``ragen.rollout.context``."""

from ragen.rollout.context import ContextConfig, ContextManager

__all__ = ["ContextConfig", "ContextManager"]
