"""The env side of episodes driven from an asyncio loop (verl's agent loop).

An episode's env, its prompts and its trajectory live in one place: the
episode function (``ragen.rollout.episode.play_episode``) on an
``EpisodeRunner``. ``EnvSide`` holds the runners: ``workers`` processes, each
a single-process loky executor with a runner of its own (an episode stays on
the process that started it: its env is there), or, with ``workers=0``, one
runner on the calling thread. Every call returns an ``EpisodeStep``: the
episode's next ``GenerationRequest``, or its ``Trajectory`` once it ended.

With processes, a costly env reset or step runs beside the asyncio loop, which
only awaits it; inline it holds every other episode of that loop. A process
that dies ends the episodes it held in ``error``; a fresh one takes the next.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from concurrent.futures import Executor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from ragen.llm.types import Completion, GenerationRequest
from ragen.rollout.env_calls import EnvSlot, KeptEnvs
from ragen.rollout.episode import EnvTurns, Playing
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.types import EnvSpec, StopReason, Trajectory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeStep:
    """Where an episode stands: its next request, or (``request`` None) its trajectory."""

    request: GenerationRequest | None
    trajectory: Trajectory | None = None


class EpisodeRunner:
    """Episodes by key, each played by ``play_episode`` over envs kept between episodes."""

    def __init__(self) -> None:
        self._turns: dict[str, EnvTurns] = {}  # by repr(LoopConfig): one per rollout setting
        self._playing: dict[str, tuple[Playing, EnvTurns]] = {}
        self._kept = KeptEnvs()

    def start(self, key: str, spec: EnvSpec, config: LoopConfig) -> EpisodeStep:
        turns = self._turns.get(repr(config))
        if turns is None:
            turns = self._turns[repr(config)] = EnvTurns(config, self._kept, isolate=True)
        episode = Playing(EnvSlot(spec), turns)
        self._playing[key] = (episode, turns)
        episode.advance()
        return self._step(key, episode)

    def advance(self, key: str, completion: Completion) -> EpisodeStep:
        episode, _ = self._episode(key)
        episode.advance(completion)
        return self._step(key, episode)

    def end(self, key: str, reason: StopReason, message: str | None) -> EpisodeStep:
        """The episode ended from outside, in ``reason``: with ``message`` as its error
        (the engine's reply at fault), or without (a budget ran out)."""
        episode, turns = self._episode(key)
        if message is None:
            episode.slot.finish(reason)
        else:
            turns.end(episode.slot, reason, message)
        episode.close()
        return self._step(key, episode)

    def _episode(self, key: str) -> tuple[Playing, EnvTurns]:
        found = self._playing.get(key)
        if found is None:
            raise KeyError(f"episode {key!r} is not on this process (pid {os.getpid()}): its process was "
                           "restarted after a failure, or it ended already")
        return found

    def _step(self, key: str, episode: Playing) -> EpisodeStep:
        if episode.request is not None:
            return EpisodeStep(episode.request)
        del self._playing[key]
        slot = episode.slot
        if slot.env is not None:  # a later episode of the tag reuses it
            self._kept.release(slot.spec, slot.env)
            slot.env = None
        return EpisodeStep(None, slot.traj)

    def __len__(self) -> int:
        return len(self._playing)


_RUNNER: EpisodeRunner | None = None  # a worker process's own


def _run(method: str, *args: Any) -> EpisodeStep:
    """``method`` of this process's runner (what a worker process is sent)."""
    global _RUNNER
    if _RUNNER is None:
        _RUNNER = EpisodeRunner()
    return getattr(_RUNNER, method)(*args)


class EnvSide:
    """Where episodes' envs run: ``workers`` processes (0: the calling thread)."""

    def __init__(self, workers: int, make_executor: Callable[[], Executor] | None = None) -> None:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ValueError(f"EnvSide: workers must be a whole number >= 0, got {workers!r}")
        self.workers = workers
        self._make = make_executor or _single_process
        self._executors: list[Executor | None] = [None] * workers
        self._home: dict[str, tuple[int, EnvSpec]] = {}  # episode key -> its worker, its spec
        self._load = [0] * workers
        self._inline = EpisodeRunner() if workers == 0 else None
        self._keys = itertools.count()

    def new_key(self) -> str:
        return f"{os.getpid()}-{next(self._keys)}"

    async def start(self, key: str, spec: EnvSpec, config: LoopConfig) -> EpisodeStep:
        worker = min(range(self.workers), key=self._load.__getitem__) if self.workers else 0
        self._home[key] = (worker, spec)
        if self.workers:
            self._load[worker] += 1
        return await self._call(key, "start", key, spec, config)

    async def advance(self, key: str, completion: Completion) -> EpisodeStep:
        return await self._call(key, "advance", key, completion)

    async def end(self, key: str, reason: StopReason, message: str | None = None) -> EpisodeStep:
        return await self._call(key, "end", key, reason, message)

    async def _call(self, key: str, method: str, *args: Any) -> EpisodeStep:
        """The runner's ``method``; a failure of the runner or its process ends this episode alone."""
        worker, spec = self._home[key]
        executor = None
        try:
            if self._inline is not None:
                step = getattr(self._inline, method)(*args)
            else:
                executor = self._executors[worker]
                if executor is None:
                    executor = self._executors[worker] = self._make()
                # Unbounded wait, for a reason: each env call in the process is bounded by
                # agent_proxy.env_timeout_s where it is set (EnvCaller), and a process that
                # dies fails this future (BrokenProcessPool).
                step = await asyncio.get_running_loop().run_in_executor(executor, partial(_run, method, *args))
        except Exception as exc:  # noqa: BLE001 - the episode ends in error; the others go on
            if isinstance(exc, BrokenProcessPool) and self._executors[worker] is executor:
                logger.warning("env worker %d died (%s); its episodes end in error, a fresh process takes the "
                               "next", worker, exc)
                self._executors[worker] = None
                executor.shutdown(wait=False)
            else:
                logger.warning("episode %s (tag %s, seed %s) ends in error: %s: %s", key, spec.tag, spec.seed,
                               type(exc).__name__, exc, exc_info=not isinstance(exc, BrokenProcessPool))
            step = EpisodeStep(None, _lost(spec, exc))
        if step.request is None:
            self._home.pop(key, None)
            if self.workers:
                self._load[worker] -= 1
        return step

    def close(self) -> None:
        for executor in self._executors:
            if executor is not None:
                executor.shutdown(wait=False)
        self._executors = [None] * self.workers


def _lost(spec: EnvSpec, exc: BaseException) -> Trajectory:
    """The trajectory of an episode whose runner failed: no turns, in error."""
    return Trajectory(env_id=spec.env_id, group_id=spec.group_id, tag=spec.tag, seed=spec.seed,
                      stop_reason=StopReason.ERROR, error=f"the episode's env side failed: {type(exc).__name__}: {exc}")


def _single_process() -> Executor:
    from loky import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=1)
