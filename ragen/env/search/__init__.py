"""The search env (``env_type: search``): answer questions by searching a corpus on a retrieval server."""

from .config import SearchEnvConfig
from .env import SearchEnv

__all__ = ["SearchEnv", "SearchEnvConfig"]
