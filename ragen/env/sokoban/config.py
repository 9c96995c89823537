"""Configuration of the Sokoban env (RAGEN's ``SokobanEnvConfig`` fields).

Room size is ``dim_room = (rows, cols)``, or ``dim_x`` (rows) and ``dim_y``
(cols) together as in RAGEN's yaml files (they win over ``dim_room``; one
without the other is an error, where RAGEN would ignore it). ``generator``
picks the rooms: ``ragen`` (the default) makes RAGEN's room for each seed
(``ragen_rooms``), where ``search_depth`` bounds RAGEN's reverse-play search in
moves and pulls; ``fast`` makes our own rooms (``generator``), where it bounds
the search in pulls. Values are checked in ``__post_init__``; errors name the
field. Sizes are bounded: a side of the room is 3 to ``MAX_ROOM_SIDE`` cells
(walls included), the boxes fit inside the walls with the player and one free
cell, and ``search_depth`` is at most the generator's state budget, past which
its search stops anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base import BaseEnvConfig
from ..config_checks import EnvConfigError, check_int
from ..grid import check_grid_settings
from .generator import MAX_REVERSE_STATES, room_fits
from .ragen_rooms import MAX_EXPLORED_STATES

__all__ = ["GENERATORS", "MAX_ROOM_SIDE", "SokobanEnvConfig"]

# Room generators: RAGEN's rooms, exactly (the default), or our own faster, harder ones.
GENERATORS = ("ragen", "fast")
# The longest side of a room, walls included (FrozenLake's bound too): RAGEN's generator keeps
# up to MAX_EXPLORED_STATES states of about 2 x rows x cols bits each while it makes a room.
MAX_ROOM_SIDE = 64
# search_depth at most: a generator's search stops at its state budget, so a deeper one is the same search
MAX_SEARCH_DEPTH = {"ragen": MAX_EXPLORED_STATES, "fast": MAX_REVERSE_STATES}


def _default_grid_lookup() -> dict[int, str]:
    return {0: "#", 1: "_", 2: "O", 3: "√", 4: "X", 5: "P", 6: "S"}


def _default_grid_vocab() -> dict[str, str]:
    return {
        "#": "wall",
        "_": "empty",
        "O": "target",
        "√": "box on target",
        "X": "box",
        "P": "player",
        "S": "player on target",
    }


def _default_action_lookup() -> dict[int, str]:
    return {1: "Up", 2: "Down", 3: "Left", 4: "Right"}


@dataclass
class SokobanEnvConfig(BaseEnvConfig):
    """Sokoban's settings: room size, boxes, generator search depth, step limit and how the grid
    is written."""

    dim_room: tuple[int, int] = (6, 6)
    max_steps: int = 100
    num_boxes: int = 3
    search_depth: int = 300
    grid_lookup: dict[int, str] = field(default_factory=_default_grid_lookup)
    grid_vocab: dict[str, str] = field(default_factory=_default_grid_vocab)
    action_lookup: dict[int, str] = field(default_factory=_default_action_lookup)
    dim_x: int | None = None
    dim_y: int | None = None
    render_mode: str = "text"
    observation_format: str = "grid"
    generator: str = "ragen"

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.dim_x is None) != (self.dim_y is None):
            # RAGEN reads them only as a pair and would silently keep dim_room
            given, missing = ("dim_x", "dim_y") if self.dim_y is None else ("dim_y", "dim_x")
            raise EnvConfigError(given, f"given without {missing}: set both (rows and cols), or dim_room")
        if self.dim_x is not None:
            self.dim_room = (self.dim_x, self.dim_y)
        dim = self.dim_room
        if isinstance(dim, (str, bytes)) or not hasattr(dim, "__len__") or len(dim) != 2:
            raise EnvConfigError("dim_room", f"expected (rows, cols), got {dim!r}")
        names = ("dim_x" if self.dim_x is not None else "dim_room", "dim_y" if self.dim_y is not None else "dim_room")
        rows = check_int(names[0], dim[0])
        cols = check_int(names[1], dim[1])
        for name, value in zip(names, (rows, cols)):
            if value < 3:
                raise EnvConfigError(name, f"the room must be at least 3x3 (walls included), got {rows}x{cols}")
            if value > MAX_ROOM_SIDE:
                raise EnvConfigError(name, f"the room is at most {MAX_ROOM_SIDE}x{MAX_ROOM_SIDE} (walls included), "
                                           f"got {rows}x{cols}")
        self.dim_room = (rows, cols)
        self.dim_x, self.dim_y = rows, cols
        self.num_boxes = check_int("num_boxes", self.num_boxes, minimum=1)
        if not room_fits(rows, cols, self.num_boxes):
            raise EnvConfigError(
                "num_boxes",
                f"{self.num_boxes} boxes do not fit in a {rows}x{cols} room "
                f"(at most {max(0, (rows - 2) * (cols - 2) - 2)}: the player and one free cell need room too)",
            )
        self.max_steps = check_int("max_steps", self.max_steps, minimum=1)
        if self.generator not in GENERATORS:
            raise EnvConfigError("generator", f"must be one of {list(GENERATORS)}, got {self.generator!r}")
        # RAGEN's search explores nothing at depth 1 (its reset then fails)
        self.search_depth = check_int("search_depth", self.search_depth, minimum=2 if self.generator == "ragen" else 1,
                                      maximum=MAX_SEARCH_DEPTH[self.generator])
        check_grid_settings(self, codes=7)
