"""The scheduler's batching policies: which episodes' requests go to the engine together.

A stream is a list of episodes with one request in flight. ``Lockstep`` is
RAGEN's order: the envs split into ``depth`` streams of whole groups, one
engine call a turn each (the chunks a worker takes past ``depth`` ride along
and merge into them); ``EnvLevel`` gives every env a stream of its own, for an
engine that answers each request as soon as it is done. ``choose_batching``
picks one from the config and the client. Every policy leaves the
trajectories alone: an answer depends only on its own request.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Sequence, TypeVar

from ragen.llm.types import EngineError
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.types import EnvSpec
from ragen.rollout.workers.schedule import groups_of
from ragen.utils import deal

T = TypeVar("T")


@dataclass(frozen=True)
class Batching:
    """How a scheduler forms streams. ``max_live_envs``: with chunks taken from the
    rollout's queue, the next chunk waits while this many envs play (None: no limit)."""

    max_live_envs: int | None = None
    hold = False  # a request may wait (briefly) to share a message with others
    bounded_wait = False  # a request is waited for at most engine_timeout_s (its envs then end in timeout)

    def streams(self, episodes: Sequence[T]) -> list[list[T]]:
        """The streams the episodes played from the start form."""
        raise NotImplementedError

    def chunk_streams(self, episodes: list[T], open_streams: int) -> list[tuple[list[T], bool]]:
        """The streams of a chunk taken while ``open_streams`` are open, each with whether
        it rides along (merges into another stream answered with it)."""
        raise NotImplementedError

    def ends_alone(self, exc: EngineError) -> bool:
        """Whether the engine's error for one stream's request ends that stream's envs
        (otherwise the scheduler raises it)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Lockstep(Batching):
    """RAGEN's loop split into ``depth`` streams of whole groups: while one stream waits
    for the model, another steps its envs. A chunk taken past ``depth`` streams rides
    along. An engine's error for a stream ends its envs only when the manager timed
    the request out; any other is raised."""

    depth: int = 1

    def streams(self, episodes: Sequence[T]) -> list[list[T]]:
        return split_streams(episodes, self.depth) if episodes else []

    def chunk_streams(self, episodes: list[T], open_streams: int) -> list[tuple[list[T], bool]]:
        return [(episodes, open_streams + 1 > self.depth)]

    def ends_alone(self, exc: EngineError) -> bool:
        return exc.timed_out


@dataclass(frozen=True)
class EnvLevel(Batching):
    """Every env a stream of its own, with no barrier between envs: an env takes its next
    turn as soon as its own answer is in and its step done. Requests that became ready
    together share a message (``hold``); each is waited for at most the config's
    ``engine_timeout_s``; an engine's error for one request ends that env alone."""

    hold = True
    bounded_wait = True

    def streams(self, episodes: Sequence[T]) -> list[list[T]]:
        return [[e] for e in episodes]

    def chunk_streams(self, episodes: list[T], open_streams: int) -> list[tuple[list[T], bool]]:
        return [([e], False) for e in episodes]

    def ends_alone(self, exc: EngineError) -> bool:
        return True


def choose_batching(config: LoopConfig, streams: bool, depth: int = 1,
                    max_live_envs: int | None = None) -> Batching:
    """``EnvLevel`` when ``config.env_level_async`` asks for it (auto: when the client
    ``streams``, its engine answering each request as it finishes), else ``Lockstep``."""
    mode = config.env_level_async
    if streams if mode == "auto" else bool(mode):
        return EnvLevel(max_live_envs=max_live_envs)
    return Lockstep(max_live_envs=max_live_envs, depth=depth)


def stream_count(specs: Sequence[EnvSpec], depth: int) -> int:
    """How many streams ``Lockstep(depth)`` splits these specs into."""
    return max(1, min(depth, len({s.group_id for s in specs})))


def split_streams(episodes: Sequence[T], depth: int,
                  group_id: Callable[[Any], int] = attrgetter("spec.group_id")) -> list[list[T]]:
    """``depth`` streams of whole groups (fewer when there are fewer groups),
    dealt out in turn so that each gets a share of every tag."""
    members = groups_of(episodes, group_id)
    depth = max(1, min(depth, len(members)))
    return [[e for g in hand for e in g] for hand in deal(members, depth)]
