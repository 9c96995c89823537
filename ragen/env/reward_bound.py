"""The bound on a reward: a finite number within +-``es_manager.max_abs_reward``.

One check for every source of a reward: an env's step (``ragen.rollout.turn``) and an
agent program's result (``ragen.agents.result``). A reward that is not a number, not
finite or beyond the bound ends its episode in error (``EnvOutputError``): one such
reward in a group's sum makes the group's advantages NaN, or swamps every other.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

from ragen.errors import RagenError

__all__ = ["DEFAULT_MAX_ABS_REWARD", "EnvOutputError", "checked_reward"]

DEFAULT_MAX_ABS_REWARD = 1.0e6  # es_manager.max_abs_reward's default


class EnvOutputError(RagenError):
    """An env returned a value the loop cannot use (an observation that is not
    text, a reward that is not a finite number or is beyond
    ``es_manager.max_abs_reward``): it ends that env in ``error``, as an
    exception raised by the env would."""


def checked_reward(r: Any, max_abs: float, where: str, source: str = "step") -> float:
    """A reward as a number: a Python int or float as it is (a prompt shows the sum as RAGEN
    does, ``0`` or ``0.0``), anything else as a float. A string, a non-number, a NaN/infinite one or
    one beyond +-``max_abs`` (``es_manager.max_abs_reward``) is refused, naming ``where`` (the tag
    and the step) and ``source`` (what gave it: ``step``, an agent's entry)."""
    try:
        value = None if isinstance(r, (str, bytes)) else float(r)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int too large for a float
        value = None
    if value is None:
        raise EnvOutputError(f"{source} returned a reward of type {type(r).__name__} ({reprlib.repr(r)}), "
                             f"not a number ({where}): return the reward as a float")
    if not math.isfinite(value):
        raise EnvOutputError(f"{source} returned the reward {value}, not a finite number ({where})")
    if abs(value) > max_abs:
        raise EnvOutputError(f"{source} returned the reward {value:g}, beyond es_manager.max_abs_reward="
                             f"{max_abs:g} ({where}): return a smaller reward, or raise the bound")
    return r if type(r) in (int, float) else value
