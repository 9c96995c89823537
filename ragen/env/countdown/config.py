"""Configuration of the Countdown env.

Each puzzle has ``num_count`` numbers drawn from ``1..max_number`` and a target
in ``1..max_target`` built from them, so it is solvable by construction.
``score`` rewards a correct equation, ``format_score`` one that writes the
puzzle's numbers but misses the target (RAGEN's values 1 and 0.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import BaseEnvConfig
from ..config_checks import check_int, check_number, check_str

__all__ = ["CountdownEnvConfig"]


@dataclass
class CountdownEnvConfig(BaseEnvConfig):
    """The Countdown env's settings: the count and range of the numbers, the target's range, and the two scores."""

    num_count: int = 4
    max_number: int = 100
    max_target: int = 100
    score: float = 1
    format_score: float = 0.1
    render_mode: str = "text"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.num_count = check_int("num_count", self.num_count, minimum=2, maximum=6)
        self.max_number = check_int("max_number", self.max_number, minimum=1, maximum=10**6)
        self.max_target = check_int("max_target", self.max_target, minimum=1, maximum=10**9)
        # kept as given (an int stays an int): "Your answer get 1 points." as RAGEN writes it
        check_number("score", self.score)
        check_number("format_score", self.format_score)
        self.render_mode = check_str("render_mode", self.render_mode, choices=("text",))
