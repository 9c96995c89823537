"""Envs played on env servers over HTTP (OpenEnv's WebSocket session protocol):
the client env (``env_type: remote``) and the server that hosts envs
(``python -m ragen.tools.env_server``)."""

from .config import RemoteEnvConfig
from .env import RemoteEnv, RemoteEnvError, RemoteEnvTimeout

__all__ = ["RemoteEnv", "RemoteEnvConfig", "RemoteEnvError", "RemoteEnvTimeout"]
