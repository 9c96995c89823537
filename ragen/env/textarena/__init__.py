"""TextArena's single-player text games as an env (``env_type: textarena``)."""

from .config import TextArenaEnvConfig
from .env import TextArenaEnv

__all__ = ["TextArenaEnv", "TextArenaEnvConfig"]
