"""Two-armed bandit: pick the arm whose name suggests the better payoff."""

from .config import BanditEnvConfig
from .env import BanditEnv

__all__ = ["BanditEnv", "BanditEnvConfig"]
