"""reasoning-gym's procedural tasks as an env (``env_type: reasoning_gym``)."""

from .config import ReasoningGymEnvConfig
from .env import ReasoningGymEnv

__all__ = ["ReasoningGymEnv", "ReasoningGymEnvConfig"]
