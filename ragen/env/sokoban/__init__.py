"""Sokoban: the env, its config, the room generator and a shortest-path solver.

``SokobanEnv`` plays gym-sokoban's rules over rooms from ``generate_room``
(reverse play from the solved state, so every room is solvable); ``solve``
finds shortest solutions for tests and benchmarks.
"""

from .config import SokobanEnvConfig
from .env import SokobanEnv
from .generator import GeneratedRoom, generate_room
from .solver import solve

__all__ = ["GeneratedRoom", "SokobanEnv", "SokobanEnvConfig", "generate_room", "solve"]
