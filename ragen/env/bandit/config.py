"""Configuration of the two-armed bandit env: RAGEN's ``BanditEnvConfig`` fields and defaults.

Each episode draws a pair of arm names from ``split``'s list (``ARM_NAMES``,
RAGEN's): a low-risk arm that always pays ``lo_arm_score`` and a high-risk arm
that pays ``hi_arm_hiscore`` with probability ``hi_arm_hiscore_prob``, else
``hi_arm_loscore``. The names carry the signal the agent is meant to read;
``test`` holds pairs kept out of ``train``. Action ids start at
``action_space_start``. ``action_lookup`` is accepted as in RAGEN, where the env
sets it at each reset (the drawn names), so a given value has no effect.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..base import BaseEnvConfig
from ..config_checks import EnvConfigError, check_int, check_number, check_str

__all__ = ["ARM_NAMES", "BanditEnvConfig"]

# (low-risk name, high-risk name) per split, in RAGEN's order (a seed picks one by index)
ARM_NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "train": (
        ("Teacher", "Trader"), ("Nurse", "StartupFounder"), ("Librarian", "Investor"),
        ("Accountant", "StockBroker"), ("Engineer", "RealEstateAgent"), ("Pharmacist", "Musician"),
        ("Clerk", "Freelancer"), ("Technician", "Youtuber"), ("Planner", "Artist"), ("Postman", "Pilot"),
        ("Banker", "VentureCapitalist"), ("Gardener", "Cryptominer"),
    ),
    "test": (
        ("Receptionist", "Explorer"), ("Archivist", "Filmmaker"), ("Bookkeeper", "Consultant"),
        ("SocialWorker", "Photographer"), ("Mechanic", "GameDesigner"), ("Secretary", "Entrepreneur"),
        ("Cashier", "DataScientist"), ("CivilServant", "StartupAccelerator"),
    ),
}


def _score(field: str, value: Any, minimum: float | None = None, maximum: float | None = None) -> float | int:
    # kept as given (an int stays an int) so that "<arm>: <reward> points" reads as RAGEN writes it
    check_number(field, value, minimum, maximum)
    return int(value) if isinstance(value, numbers.Integral) else float(value)


@dataclass
class BanditEnvConfig(BaseEnvConfig):
    """The two-armed bandit's settings (RAGEN's fields): the split of arm names, the ids and the rewards."""

    split: str = "train"
    action_space_start: int = 1
    lo_arm_score: float = 0.1
    hi_arm_loscore: float = 0.0
    hi_arm_hiscore: float = 1.0
    hi_arm_hiscore_prob: float = 0.25
    render_mode: str = "text"
    action_lookup: dict[int, str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.split = check_str("split", self.split, choices=tuple(ARM_NAMES))
        # an action id: a 32-bit int (a dump writes it as JSON, which refuses ints of thousands of digits)
        self.action_space_start = check_int("action_space_start", self.action_space_start, minimum=-2**31,
                                            maximum=2**31 - 1)
        self.lo_arm_score = _score("lo_arm_score", self.lo_arm_score)
        self.hi_arm_loscore = _score("hi_arm_loscore", self.hi_arm_loscore)
        self.hi_arm_hiscore = _score("hi_arm_hiscore", self.hi_arm_hiscore)
        self.hi_arm_hiscore_prob = _score("hi_arm_hiscore_prob", self.hi_arm_hiscore_prob, 0.0, 1.0)
        self.render_mode = check_str("render_mode", self.render_mode, choices=("text",))
        if self.action_lookup is not None and not isinstance(self.action_lookup, Mapping):
            raise EnvConfigError("action_lookup", f"expected a mapping of ids to arm names, got {self.action_lookup!r}")

    def reward_and_success(self) -> str:
        p, hi, lo = self.hi_arm_hiscore_prob, self.hi_arm_hiscore, self.hi_arm_loscore
        return (f"Bandit: success is pulling the high-risk arm (worth {p * hi + (1 - p) * lo:g} in expectation, "
                f"the low-risk arm {self.lo_arm_score:g}); the reward is that one pull's draw ({hi:g} with "
                f"probability {p:g}, else {lo:g}), so success can rise while the mean reward stays noisy or falls")
