"""Text renderings shared by the grid envs (Sokoban, FrozenLake).

``observation_format`` (RAGEN's key) picks what the agent sees: ``grid`` (the
map, one row per line), ``coord`` (zero-indexed ``(row, col)`` coordinates of
each kind of entity) or ``grid_coord`` (both: coordinates first, then the map).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .config_checks import EnvConfigError

OBSERVATION_FORMATS = ("grid", "coord", "grid_coord")


def check_render_settings(render_mode: object, observation_format: object) -> tuple[str, str]:
    """Validated ``(render_mode, observation_format)``; errors name the field."""
    if render_mode == "rgb_array":
        raise EnvConfigError("render_mode", "'rgb_array' (image observations) is not supported: the agent loop "
                                            "is text-only; use 'text' (and observation_format for the layout)")
    if render_mode != "text":
        raise EnvConfigError("render_mode", f"must be 'text', got {render_mode!r}")
    if observation_format not in OBSERVATION_FORMATS:
        raise EnvConfigError("observation_format",
                             f"must be one of {list(OBSERVATION_FORMATS)}, got {observation_format!r}")
    return render_mode, observation_format


def coordinates(entities: Sequence[tuple[str, Sequence[tuple[int, int]]]], rows: int, cols: int) -> str:
    """``Name: (r, c), (r, c)`` per entity kind (``none`` when absent), then the
    grid's size and corners."""
    lines = []
    for name, cells in entities:
        lines.append(f"{name}: " + (", ".join(f"({r}, {c})" for r, c in cells) if cells else "none"))
    lines.append(f"Grid: {rows} rows x {cols} columns, from (0, 0) top left to ({rows - 1}, {cols - 1}) bottom right")
    return "\n".join(lines)


def board_coordinates(entities: Sequence[tuple[str, Sequence[tuple[int, int]]]], rows: int, cols: int) -> str:
    """RAGEN's coordinate text: ``Board size: R rows x C cols (zero-indexed).``,
    then ``Name: (r, c), (r, c)`` per entity kind, kinds with no cells left out."""
    lines = [f"Board size: {rows} rows x {cols} cols (zero-indexed)."]
    for name, cells in entities:
        if cells:
            lines.append(f"{name}: " + ", ".join(f"({r}, {c})" for r, c in cells))
    return "\n".join(lines)


def render_text(mode: str, observation_format: str, grid: Callable[[], str], coord: Callable[[], str]) -> str:
    """The text of ``render(mode)``: ``text`` is the configured format; ``grid``,
    ``coord`` and ``grid_coord`` ask for one directly."""
    fmt = observation_format if mode == "text" else mode
    if fmt == "grid":
        return grid()
    if fmt == "coord":
        return coord()
    if fmt == "grid_coord":
        return f"Coordinates: \n{coord()}\nGrid Map: \n{grid()}"  # RAGEN's words, trailing spaces included
    raise ValueError(f"render mode must be 'text' or one of {list(OBSERVATION_FORMATS)}, got {mode!r}")
