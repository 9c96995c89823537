"""``Episode``: one env's episode as it plays: its env, where it stands, and the
generator playing it (``ragen.rollout.episode.play_episode``) with the request
it waits on. The env calls (``env_calls``) and the turn (``turn``) act on it;
the scheduler, ``EnvStateManager`` and verl's agent loop drive it."""

from __future__ import annotations

import functools
from typing import Any, Callable, Generator

from ragen.llm.types import Completion, GenerationRequest
from ragen.rollout.types import EnvSpec, StopReason, Trajectory, Turn


class Episode:
    """One env's episode: its spec, its env and where it stands (the observation shown, the
    actions left, the trajectory so far; ``active`` until it ends), and the generator that
    plays it (``run``: ``play_episode``, set by ``EnvTurns.start``) with the request it waits
    on (``request``; None once it ended)."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec
        self.env: Any = None
        self.traj = Trajectory(env_id=spec.env_id, group_id=spec.group_id, tag=spec.tag, seed=spec.seed)
        self.observation = ""
        self.actions_left = spec.max_actions_per_traj
        self.active = True
        self.lookup: dict[str, Any] | None = None  # lower-case action name -> action id
        self.reported = False  # its end was told to the progress callback
        self.timed = False  # its end was counted in the loop's first and last env end
        self.run: Generator[GenerationRequest, Completion, Trajectory] | None = None
        self.request: GenerationRequest | None = None

    def add(self, turn: Turn) -> None:
        """A turn played: added to the trajectory, which succeeds once a turn's info says so."""
        self.traj.turns.append(turn)
        if turn.info.get("success"):
            self.traj.success = True

    def finish(self, reason: StopReason, error: str | None = None) -> None:
        """The episode's end: its stop reason, error and the observation it ended on."""
        self.active = False
        self.traj.stop_reason = reason
        self.traj.error = error
        self.traj.final_observation = self.observation

    def advance(self, completion: Completion | None = None) -> None:
        """The episode played to its next request (``completion``: the answer to the last)."""
        try:
            self.request = self.run.send(completion)
        except StopIteration:
            self.request = None

    @property
    def ended(self) -> bool:
        """Whether ``play_episode`` has ended: returned, closed, or stopped by an exception."""
        return self.run is None or self.run.gi_frame is None

    def job(self, completion: Completion | None = None) -> Callable[[], None]:
        """``advance`` as a job for ``EnvThreads``."""
        return functools.partial(self.advance, completion)

    def close(self) -> None:
        """Ended from outside: the generator closes where it stands."""
        self.request = None
        self.run.close()
