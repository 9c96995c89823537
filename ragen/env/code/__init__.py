"""The code env (``env_type: code``): write a program, run against tests in a sandbox."""

from .config import CodeEnvConfig
from .env import CodeEnv

__all__ = ["CodeEnv", "CodeEnvConfig"]
