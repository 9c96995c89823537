"""Grid pictures of text observations.

- ``Cell``: one square of a grid env's map: the symbol as written, its
  ``kind`` (the env's ``grid_vocab`` name as a slug: ``wall``, ``box-on-target``,
  ``hole``, ``player-on-goal``, ...), the ``terrain`` under it (``wall``,
  ``target``, ``hole``, ``goal`` or ``floor``) and whether a player or a box
  stands on it.
- ``GridPicture``: a parsed observation: the rows of cells, plus the text that
  came with the map (the coordinates of ``observation_format: grid_coord``).
- ``Symbols``: what an env's symbols mean, taken from its config class
  (``grid_vocab``, so custom vocabularies are drawn right), else from the
  default tables of Sokoban and FrozenLake, else none: the observation is shown
  as text. A config class is built (``env_config``) only for an env type the
  user's setup names (``ragen.env.allowed``); the dump's other types are never
  imported.
- ``picture(observation, symbols)``: the ``GridPicture`` of one observation, or
  ``None`` when it is not a map in those symbols (coordinates only, a bandit's
  story, a countdown's numbers).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from ragen.env import make_env_config
from ragen.env.allowed import AllowedEnvTypes, EnvTypeNotAllowed
from ragen.env.frozen_lake.config import FrozenLakeEnvConfig
from ragen.env.sokoban.config import SokobanEnvConfig
from ragen.rollout.types import EnvSpec

logger = logging.getLogger(__name__)

# what a dump names its grid envs, when their config class cannot be had
DEFAULT_VOCABS: dict[str, dict[str, str]] = {
    "sokoban": SokobanEnvConfig().grid_vocab,
    "frozen_lake": FrozenLakeEnvConfig().grid_vocab,
}
_TERRAINS = ("wall", "target", "hole", "goal")
# grid_coord's heading before the map: RAGEN's words (with a trailing space); dumps
# written before the observations followed RAGEN's text have it without the space
_GRID_MAP_HEADINGS = ("Grid Map: \n", "Grid Map:\n")


@dataclass(frozen=True)
class Cell:
    """One square of a grid env's map: its symbol, kind, terrain, and whether a player or box is on it."""

    symbol: str
    kind: str  # the vocab name as a slug: "box-on-target"
    terrain: str  # wall, target, hole, goal or floor
    player: bool
    box: bool


@dataclass(frozen=True)
class GridPicture:
    """A parsed observation: the map's rows of cells and the text that came before the map."""

    rows: list[list[Cell]]
    text: str = ""  # what came before the map (grid_coord's coordinates), "" for a plain map


@dataclass(frozen=True)
class Symbols:
    """What an env's map symbols mean: each one-character symbol -> its ``Cell``."""

    cells: dict[str, Cell]  # symbol -> its cell

    @classmethod
    def from_vocab(cls, vocab: dict[str, str]) -> Symbols:
        return cls({symbol: _cell(symbol, name) for symbol, name in vocab.items() if len(symbol) == 1})


def _cell(symbol: str, name: str) -> Cell:
    words = re.findall(r"[a-z0-9]+", name.lower())
    terrain = next((t for t in _TERRAINS if t in words), "floor")
    return Cell(symbol, "-".join(words) or "unknown", terrain, "player" in words, "box" in words)


def env_config(spec: EnvSpec, env_types: AllowedEnvTypes | None = None) -> Any:
    """The config of ``spec``'s env (cheap, no env), built only when ``env_types``
    (default: the registered names) allows its type; None where it is not built
    (the log says why). Callers keep one per ``spec.reuse_key``."""
    try:
        (env_types if env_types is not None else AllowedEnvTypes()).check(spec.env_type, spec.config_type, spec.tag)
        return make_env_config(spec.env_type, spec.env_config, spec.config_type, spec.tag)
    except EnvTypeNotAllowed as exc:  # the dump's own type: drawn without its code
        logger.warning("env %s: config not built, default symbols used: %s", spec.tag, exc)
    except (ImportError, ValueError, TypeError) as exc:  # a custom env not importable here: use the defaults
        logger.info("env %s (%s): config not built (%s); using the default symbols", spec.tag, spec.env_type, exc)
    return None


def symbols_for(spec: EnvSpec, config: Any) -> Symbols | None:
    """The symbols of ``spec``'s env, given its ``config`` (``env_config``; None: the
    defaults of its type), or None when it draws no grid."""
    vocab = getattr(config, "grid_vocab", None)
    if not isinstance(vocab, dict):
        vocab = DEFAULT_VOCABS.get(spec.env_type)
    if not vocab:
        return None
    return Symbols.from_vocab({str(k): str(v) for k, v in vocab.items()})


def picture(observation: str, symbols: Symbols | None) -> GridPicture | None:
    """The map in ``observation`` as cells, or None when there is none."""
    if symbols is None or not observation:
        return None
    text, grid = "", observation
    for heading in _GRID_MAP_HEADINGS:
        at = observation.find(heading)
        if at >= 0:
            text, grid = observation[:at].rstrip("\n"), observation[at + len(heading):]
            break
    lines = grid.strip("\n").split("\n")
    if not lines or not lines[0] or len({len(line) for line in lines}) != 1:
        return None
    try:
        rows = [[symbols.cells[ch] for ch in line] for line in lines]
    except KeyError:
        return None
    return GridPicture(rows, text)
