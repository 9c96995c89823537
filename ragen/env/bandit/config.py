"""Configuration of the two-armed bandit env (RAGEN's ``BanditEnvConfig`` fields).

The low-risk arm ``lo_arm_name`` always pays ``lo_arm_score``; the high-risk
arm ``hi_arm_name`` pays ``hi_arm_hiscore`` with probability
``hi_arm_hiscore_prob``, else ``hi_arm_loscore``. The names carry the signal
the agent is meant to read ("phoenix"/"dragon" to train, "librarian"/"trader"
to test transfer). With ``split`` ("train" or "test", RAGEN's key) the two
names are drawn per episode from that split's list of (low-risk, high-risk)
name pairs (``ARM_NAME_PAIRS``) instead, and ``lo_arm_name``/``hi_arm_name``
are not used.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import BaseEnvConfig
from ..config_checks import EnvConfigError, check_int, check_number, check_str

__all__ = ["ARM_NAME_PAIRS", "BanditEnvConfig"]

# (low-risk name, high-risk name): the name says which arm is the gamble
ARM_NAME_PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "train": (
        ("Clerk", "Gambler"), ("Tortoise", "Hare"), ("Savings", "Lottery"), ("Auditor", "Daredevil"),
        ("Umbrella", "Kite"), ("Bond", "Startup"), ("Anchor", "Rocket"), ("Miller", "Prospector"),
    ),
    "test": (
        ("Notary", "Stuntman"), ("Pension", "Casino"), ("Lighthouse", "Comet"), ("Tailor", "Treasure Hunter"),
    ),
}


@dataclass
class BanditEnvConfig(BaseEnvConfig):
    """The two-armed bandit's settings: the arms' names (or a ``split`` of name pairs) and rewards."""

    lo_arm_name: str = "phoenix"
    hi_arm_name: str = "dragon"
    action_space_start: int = 1
    lo_arm_score: float = 0.1
    hi_arm_loscore: float = 0.0
    hi_arm_hiscore: float = 1.0
    hi_arm_hiscore_prob: float = 0.25
    render_mode: str = "text"
    split: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.lo_arm_name = check_str("lo_arm_name", self.lo_arm_name).strip()
        self.hi_arm_name = check_str("hi_arm_name", self.hi_arm_name).strip()
        if self.lo_arm_name.lower() == self.hi_arm_name.lower():
            raise EnvConfigError("hi_arm_name", f"the two arms need different names, both are {self.hi_arm_name!r}")
        self.action_space_start = check_int("action_space_start", self.action_space_start)
        self.lo_arm_score = check_number("lo_arm_score", self.lo_arm_score)
        self.hi_arm_loscore = check_number("hi_arm_loscore", self.hi_arm_loscore)
        self.hi_arm_hiscore = check_number("hi_arm_hiscore", self.hi_arm_hiscore)
        self.hi_arm_hiscore_prob = check_number("hi_arm_hiscore_prob", self.hi_arm_hiscore_prob, 0.0, 1.0)
        self.render_mode = check_str("render_mode", self.render_mode, choices=("text",))
        if self.split is not None:
            self.split = check_str("split", self.split, choices=tuple(ARM_NAME_PAIRS))
