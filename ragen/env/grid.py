"""What the grid envs (Sokoban, FrozenLake) share: ``check_grid_settings``, the
one check of a grid config's lookups and rendering keys, and ``GridEnv``, the
base env that takes its lookups from that config and renders through
``ragen.env.render``."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

from .base import BaseDiscreteActionEnv
from .config_checks import EnvConfigError, check_lookup
from .render import check_render_settings, render_text


def check_grid_settings(cfg: Any, codes: int) -> None:
    """Checks (and normalises in place) a grid env config's ``grid_lookup``
    (cell codes ``0..codes-1``), ``grid_vocab``, ``action_lookup`` (ids 1 to 4),
    ``render_mode`` and ``observation_format``; errors name the field."""
    cfg.grid_lookup = check_lookup("grid_lookup", cfg.grid_lookup, keys=range(codes))
    if not isinstance(cfg.grid_vocab, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in cfg.grid_vocab.items()
    ):
        raise EnvConfigError("grid_vocab", f"expected a mapping of symbols to names, got {cfg.grid_vocab!r}")
    cfg.grid_vocab = dict(cfg.grid_vocab)
    cfg.action_lookup = check_lookup("action_lookup", cfg.action_lookup, keys=(1, 2, 3, 4), unique_values=True)
    cfg.render_mode, cfg.observation_format = check_render_settings(cfg.render_mode, cfg.observation_format)


class GridEnv(BaseDiscreteActionEnv):
    """A discrete-action env drawn as a grid.

    It takes ``GRID_LOOKUP``, ``ACTION_LOOKUP`` and ``render_mode`` from its
    config; a subclass draws the map (``_grid``) and the entities'
    coordinates (``_coordinates``), and says whether an episode was reset
    (``_started``: ``render`` shows nothing before).
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.GRID_LOOKUP = dict(self.config.grid_lookup)
        self.ACTION_LOOKUP = dict(self.config.action_lookup)
        self.render_mode = self.config.render_mode

    def render(self, mode: str | None = None) -> str:
        if not self._started():
            return ""
        return render_text(mode or self.render_mode, self.config.observation_format, self._grid, self._coordinates)

    @abstractmethod
    def _started(self) -> bool:
        """Whether an episode was reset."""

    @abstractmethod
    def _grid(self) -> str:
        """The map, one row per line, each cell written with ``GRID_LOOKUP``."""

    @abstractmethod
    def _coordinates(self) -> str:
        """The entities' coordinates (``ragen.env.render.coordinates``)."""
