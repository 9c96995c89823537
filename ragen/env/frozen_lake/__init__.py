"""FrozenLake: cross slippery ice from start to goal without falling in a hole."""

from .config import FrozenLakeEnvConfig
from .env import FrozenLakeEnv, generate_map

__all__ = ["FrozenLakeEnv", "FrozenLakeEnvConfig", "generate_map"]
