"""The env side of episodes driven from an asyncio loop (verl's agent loop).

An episode's env, its prompts and its trajectory live in one place: the
episode function (``ragen.rollout.episode.play_episode``) on an
``EpisodeRunner``. ``EnvSide`` holds the runners: ``workers`` hosts of one
backend (agent_proxy.parallel_backend): a single-worker loky or
multiprocessing executor (a process), a thread, or a Ray actor, each with a
runner of its own; an episode stays on the host that started it (its env is
there). With ``workers=0`` one runner serves on the calling thread. Every call
returns an ``EpisodeStep``: the episode's next ``GenerationRequest``, or its
``Trajectory`` once it ended.

On a host, a costly env reset or step runs beside the asyncio loop, which only
awaits it; inline it holds every other episode of that loop. A host that dies
ends the episodes it held in ``error``; a fresh one takes the next.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import os
from abc import ABC, abstractmethod
from concurrent.futures import BrokenExecutor, Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from ragen.llm.types import Completion, GenerationRequest
from ragen.rollout.env_calls import KeptEnvs
from ragen.rollout.episode import EnvTurns
from ragen.rollout.episode_state import Episode
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
        self._playing: dict[str, tuple[Episode, EnvTurns]] = {}
        self._kept = KeptEnvs()

    def start(self, key: str, spec: EnvSpec, config: LoopConfig) -> EpisodeStep:
        turns = self._turns.get(repr(config))
        if turns is None:
            turns = self._turns[repr(config)] = EnvTurns(config, self._kept, isolate=True)
        episode = turns.start(spec)
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
            episode.finish(reason)
        else:
            turns.end(episode, reason, message)
        episode.close()
        return self._step(key, episode)

    def _episode(self, key: str) -> tuple[Episode, EnvTurns]:
        found = self._playing.get(key)
        if found is None:
            raise KeyError(f"episode {key!r} is not on this process (pid {os.getpid()}): its process was "
                           "restarted after a failure, or it ended already")
        return found

    def _step(self, key: str, episode: Episode) -> EpisodeStep:
        if episode.request is not None:
            return EpisodeStep(episode.request)
        del self._playing[key]
        if episode.env is not None:  # a later episode of the tag reuses it
            self._kept.release(episode.spec, episode.env)
            episode.env = None
        return EpisodeStep(None, episode.traj)

    def __len__(self) -> int:
        return len(self._playing)


_RUNNER: EpisodeRunner | None = None  # a worker process's own


def _run(method: str, *args: Any) -> EpisodeStep:
    """``method`` of this process's runner (what a worker process is sent)."""
    global _RUNNER
    if _RUNNER is None:
        _RUNNER = EpisodeRunner()
    return getattr(_RUNNER, method)(*args)


class _Host(ABC):
    """One place episodes run, started on first use; ``lost`` says whether a failure
    took the place down (then the next call starts a fresh one)."""

    @abstractmethod
    async def call(self, method: str, *args: Any) -> EpisodeStep: ...

    @abstractmethod
    def lost(self, exc: BaseException) -> bool: ...

    @abstractmethod
    def close(self) -> None: ...


class _ExecutorHost(_Host):
    """A single-worker executor: a process (loky or multiprocessing, the runner a
    process global) or a thread (the runner its own)."""

    def __init__(self, make: Callable[[], Executor], runner: EpisodeRunner | None = None) -> None:
        self._make = make
        self._runner = runner
        self._executor: Executor | None = None

    async def call(self, method: str, *args: Any) -> EpisodeStep:
        if self._executor is None:
            self._executor = self._make()
        job = partial(getattr(self._runner, method), *args) if self._runner else partial(_run, method, *args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    def lost(self, exc: BaseException) -> bool:
        if not isinstance(exc, BrokenExecutor):
            return False
        self.close()
        return True

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


class _RayHost(_Host):
    """A Ray actor holding a runner (on any node of the cluster)."""

    def __init__(self) -> None:
        self._actor: Any = None

    async def call(self, method: str, *args: Any) -> EpisodeStep:
        if self._actor is None:
            self._actor = _ray_runner_class().remote()
        return await self._actor.call.remote(method, *args)

    def lost(self, exc: BaseException) -> bool:
        import ray

        if not isinstance(exc, ray.exceptions.RayActorError):
            return False
        self.close()
        return True

    def close(self) -> None:
        if self._actor is not None:
            import ray

            ray.kill(self._actor, no_restart=True)
            self._actor = None


@functools.lru_cache(maxsize=None)
def _ray_runner_class() -> Any:
    import ray

    # No CPU reserved: verl's cluster places its own workers by GPU and CPU, and an env actor
    # waiting for a free CPU there would hold its episodes with it; its cost is the env's.
    @ray.remote(num_cpus=0)
    class RayEpisodeRunner:
        def __init__(self) -> None:
            self.runner = EpisodeRunner()

        def call(self, method: str, *args: Any) -> EpisodeStep:
            return getattr(self.runner, method)(*args)

    return RayEpisodeRunner


def _loky() -> Executor:
    from loky import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=1)


def _spawned() -> Executor:
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))


def _thread() -> Executor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragen-env")


BACKENDS = ("loky", "multiprocessing", "threading", "ray")


def _host(backend: str) -> _Host:
    if backend == "loky":
        return _ExecutorHost(_loky)
    if backend == "multiprocessing":
        return _ExecutorHost(_spawned)
    if backend == "threading":
        return _ExecutorHost(_thread, EpisodeRunner())
    return _RayHost()


class EnvSide:
    """Where episodes' envs run: ``workers`` hosts of ``backend`` (0: the calling thread).

    ``backend``: ``loky`` or ``multiprocessing`` (a process each), ``threading`` (a
    thread each: for envs that wait, not compute), ``ray`` (an actor each, anywhere
    in the Ray cluster the caller is connected to)."""

    def __init__(self, workers: int, backend: str = "loky") -> None:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ValueError(f"EnvSide: workers must be a whole number >= 0, got {workers!r}")
        if backend not in BACKENDS:
            raise ValueError(f"EnvSide: backend {backend!r} is not one of {BACKENDS}")
        self.workers = workers
        self.backend = backend
        self._hosts = [_host(backend) for _ in range(workers)]
        self._home: dict[str, tuple[int, EnvSpec]] = {}  # episode key -> its host, its spec
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
        """The runner's ``method``; a failure of the runner or its host ends this episode alone."""
        worker, spec = self._home[key]
        try:
            if self._inline is not None:
                step = getattr(self._inline, method)(*args)
            else:
                # Unbounded wait, for a reason: each env call on the host is bounded by
                # agent_proxy.env_timeout_s where it is set (EnvCaller), and a host that
                # dies fails this call (BrokenExecutor, RayActorError).
                step = await self._hosts[worker].call(method, *args)
        except Exception as exc:  # noqa: BLE001 - the episode ends in error; the others go on
            if self._inline is None and self._hosts[worker].lost(exc):
                logger.warning("env worker %d (%s) died (%s); its episodes end in error, a fresh one takes the "
                               "next", worker, self.backend, exc)
            else:
                logger.warning("episode %s (tag %s, seed %s) ends in error: %s: %s", key, spec.tag, spec.seed,
                               type(exc).__name__, exc, exc_info=True)
            step = EpisodeStep(None, _lost(spec, exc))
        if step.request is None:
            self._home.pop(key, None)
            if self.workers:
                self._load[worker] -= 1
        return step

    def close(self) -> None:
        for host in self._hosts:
            host.close()


def _lost(spec: EnvSpec, exc: BaseException) -> Trajectory:
    """The trajectory of an episode whose runner failed: no turns, in error."""
    return Trajectory(env_id=spec.env_id, group_id=spec.group_id, tag=spec.tag, seed=spec.seed,
                      stop_reason=StopReason.ERROR, error=f"the episode's env side failed: {type(exc).__name__}: {exc}")
