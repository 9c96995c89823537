"""Countdown: reach a target number with an equation over given numbers."""

from .config import CountdownEnvConfig
from .env import CountdownEnv, CountdownPuzzle, generate_puzzle
from .equation import EquationResult, parse_equation, uses_numbers_exactly

__all__ = [
    "CountdownEnv",
    "CountdownEnvConfig",
    "CountdownPuzzle",
    "EquationResult",
    "generate_puzzle",
    "parse_equation",
    "uses_numbers_exactly",
]
