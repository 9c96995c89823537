"""Configuration of the TextArena env: which game, and the game's own options.

``env_config: {env_id: Mastermind-v0, max_observation_chars: 100000, <the game's own constructor
options>}``. The game is built once here, when the config is built, and reset with one
player: an unknown ``env_id`` lists close matches, a game for two or more
players is refused (ragen plays single-player games; a fixed opponent policy
would be a policy of its own to train against, and is not built), an
option the game does not take names the key, and options whose first screen
is longer than ``max_observation_chars`` are refused. TextArena is an optional package
(``pip install -e '.[envs]'``); nothing is downloaded at run time (its games
that need nltk's word lists fail their reset naming the list; see docs/envs.md).
"""

from __future__ import annotations

import difflib
import logging
from typing import Any

from ..config_checks import EnvConfigError, check_str
from ..global_rng import GlobalRngState, own_rng
from ..observation_bound import DEFAULT_MAX_OBSERVATION_CHARS, check_max_observation_chars, check_observation

__all__ = ["TextArenaEnvConfig", "import_textarena"]

logger = logging.getLogger(__name__)

def import_textarena() -> Any:
    """``textarena``, imported without letting it download anything: its games call
    ``nltk.download`` when their module is imported; here that call only logs."""
    try:
        import nltk
    except ImportError:
        nltk = None
    if nltk is not None and not getattr(nltk.download, "_ragen_no_download", False):
        def no_download(*args: Any, **kwargs: Any) -> bool:
            logger.warning("TextArena asked nltk to download %s: ragen downloads nothing at run time; install it "
                           "beforehand (python -m nltk.downloader <name>) if the game needs it", args or kwargs)
            return False

        no_download._ragen_no_download = True
        nltk.download = no_download
    try:
        import textarena
    except ImportError as exc:
        raise EnvConfigError("env_id", "needs the textarena package: pip install -e '.[envs]' "
                                       f"(or pip install textarena==0.7.4): {exc}") from None
    return textarena


def _short(exc: BaseException) -> str:
    """An exception's text on one line (nltk's LookupError spans a framed paragraph)."""
    return " ".join(str(exc).replace("*", " ").split())[:300]


class TextArenaEnvConfig:
    """``env_id``: a TextArena game id (``Mastermind-v0``); ``max_observation_chars``: the
    longest observation; ``options``: the game's own constructor options (the other keys)."""

    SHORTHAND_KEY = "env_id"  # python -m ragen.tools.check textarena:<game id>

    def __init__(self, env_id: str = "Mastermind-v0", invalid_act: str = "", invalid_act_score: float = 0.0,
                 max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS, **options: Any) -> None:
        self.env_id = check_str("env_id", env_id)
        self.invalid_act = invalid_act
        self.invalid_act_score = invalid_act_score
        self.max_observation_chars = check_max_observation_chars(max_observation_chars)
        self.options = dict(options)
        ta = import_textarena()
        from textarena.envs.registration import ENV_REGISTRY

        if self.env_id not in ENV_REGISTRY:
            close = difflib.get_close_matches(self.env_id, list(ENV_REGISTRY), n=5, cutoff=0.5)
            hint = f"; close matches: {close}" if close else ""
            raise EnvConfigError("env_id", f"unknown TextArena game {self.env_id!r}{hint}")
        probe = GlobalRngState()  # some games draw their puzzle when built (RushHour)
        try:
            with own_rng(probe):
                game = ta.make(env_id=self.env_id, **self.options)
        except TypeError as exc:
            raise EnvConfigError(next(iter(self.options), "env_id"),
                                 f"not an option of TextArena's {self.env_id}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the game's module fails to import or build
            raise EnvConfigError("env_id", f"TextArena cannot build {self.env_id!r}: {type(exc).__name__}: "
                                           f"{_short(exc)}") from None
        try:
            with own_rng(probe):
                game.reset(num_players=1, seed=0)
                _, first = game.get_observation()
        except AssertionError as exc:  # its player count check
            raise EnvConfigError("env_id", f"{self.env_id} is not a single-player game ({exc}); ragen plays "
                                           "TextArena's single-player games only") from None
        except Exception as exc:  # noqa: BLE001 - e.g. a word list nltk would have downloaded
            raise EnvConfigError("env_id", f"{self.env_id} cannot start here: {type(exc).__name__}: "
                                           f"{_short(exc)}") from None
        check_observation(len(str(first)), self.max_observation_chars, self.source())

    def source(self) -> str:
        """The game and its options, as an error names them."""
        return f"TextArena's {self.env_id} with options {self.options}"

    def __repr__(self) -> str:
        return (f"TextArenaEnvConfig(env_id={self.env_id!r}, max_observation_chars={self.max_observation_chars}, "
                f"options={self.options})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TextArenaEnvConfig) and self._own() == other._own()

    def _own(self) -> tuple:
        return self.env_id, self.options, self.max_observation_chars
