"""The bound on the text an env library shows the model: ``max_observation_chars``.

reasoning-gym's datasets and TextArena's games take size options with no bound of their own
(chain_sum's ``max_terms``, Minesweeper's ``rows``): past some size their text fills memory and
any model's context. Their envs take ``max_observation_chars`` and refuse a longer observation
with an ``EnvConfigError`` that names the options that made it.
"""

from __future__ import annotations

from typing import Any

from .config_checks import EnvConfigError, check_int

__all__ = ["DEFAULT_MAX_OBSERVATION_CHARS", "MAX_OBSERVATION_CHARS", "check_max_observation_chars",
           "check_observation"]

DEFAULT_MAX_OBSERVATION_CHARS = 100_000  # about 25,000 tokens
MAX_OBSERVATION_CHARS = 10_000_000  # the most a config may ask for


def check_max_observation_chars(value: Any) -> int:
    """The ``max_observation_chars`` key of an env library's config."""
    return check_int("max_observation_chars", value, minimum=1, maximum=MAX_OBSERVATION_CHARS)


def check_observation(chars: int, limit: int, source: str) -> None:
    """Refuse an observation of ``chars`` characters past ``limit``; ``source`` names the env and its options."""
    if chars > limit:
        raise EnvConfigError("max_observation_chars",
                             f"{source} gave an observation of {chars:,} characters, more than "
                             f"max_observation_chars={limit:,}: make it smaller with its options, or raise the "
                             f"bound (at most {MAX_OBSERVATION_CHARS:,})")
