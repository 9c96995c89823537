"""Sokoban: the env, its config, the room generators and a shortest-path solver.

``SokobanEnv`` plays gym-sokoban's rules over rooms made by reverse play from
the solved state (so every room is solvable): RAGEN's rooms from
``generate_ragen_room`` (``generator: ragen``, the default) or our own from
``generate_room`` (``generator: fast``); ``solve`` finds shortest solutions
for tests and benchmarks.
"""

from .config import SokobanEnvConfig
from .env import SokobanEnv
from .generator import GeneratedRoom, generate_room
from .ragen_rooms import generate_ragen_room
from .solver import solve

__all__ = ["GeneratedRoom", "SokobanEnv", "SokobanEnvConfig", "generate_ragen_room", "generate_room", "solve"]
