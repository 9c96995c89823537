"""An env's lifecycle in the turn loop: instances kept between rollouts
(``KeptEnvs``), reset and step within a time limit (``EnvCaller``), on threads
where a tag allows (``EnvThreads``), retried on a fresh instance when they fail
and else ended in error (``guard``), a carried episode brought back
(``resume``), and the env's outputs checked (``checked_observation``,
``checked_reward``). Applying an answer is ``ragen.rollout.turn``'s.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import reprlib
import threading
import time
import traceback
from collections import defaultdict
from typing import Any, Callable, Iterator, Sequence, TypeVar

from ragen.env.base import action_lookup, reset_takes_mode
from ragen.env.reward_bound import EnvOutputError, checked_reward
from ragen.errors import RagenError
from ragen.llm.types import Completion
from ragen.rollout.episode_state import Episode
from ragen.rollout.loop_config import LoopConfig, LoopStats
from ragen.rollout.types import EnvSpec, Step, StopReason, Turn
from ragen.rollout.workers.executors import DaemonThreadPool

logger = logging.getLogger(__name__)

_ERRORS_LOCK = threading.Lock()
T = TypeVar("T")


class EnvTimeout(RagenError):
    """An env call ran past ``LoopConfig.env_timeout_s``."""


class EnvError(RagenError):
    """An env raised or timed out where errors are not isolated (``isolate_errors=False``):
    the caller decides what becomes of every env of the call (a parallel worker's are re-run
    by the fallback)."""


class KeptEnvs:
    """Env instances kept between rollouts, by ``EnvSpec.reuse_key``."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[Any]] = defaultdict(list)
        self.created = 0
        self._lock = threading.Lock()  # envs of a parallel_friendly tag are acquired on several threads

    def acquire(self, spec: EnvSpec) -> Any:
        with self._lock:
            free = self._free.get(spec.reuse_key)
            if free:
                return free.pop()
            self.created += 1
        from ragen.env import make_env

        return make_env(spec.env_type, spec.env_config, config_type=spec.config_type, tag=spec.tag)

    def release(self, spec: EnvSpec, env: Any) -> None:
        self._free[spec.reuse_key].append(env)

    def __len__(self) -> int:
        return sum(len(v) for v in self._free.values())

    def close(self) -> None:
        for envs in self._free.values():
            for env in envs:
                try:
                    env.close()
                except Exception:  # closing is best effort
                    logger.debug("env close failed", exc_info=True)
        self._free.clear()


class EnvCaller:
    """Runs env calls, with a time limit when one is set.

    A call past its limit leaves its thread behind (a thread cannot be killed);
    the env is then abandoned and a fresh thread serves the next calls. Each
    calling thread has its own helper thread, so envs stepped at once on a
    ``parallel_friendly`` tag's threads are timed apart.
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._helpers: list[DaemonThreadPool] = []

    def __call__(self, fn, *args, **kwargs):
        if not self.timeout_s:
            return fn(*args, **kwargs)
        helper = getattr(self._local, "helper", None)
        if helper is None:
            # daemon threads: a call abandoned past its limit must not keep the process from exiting
            helper = self._local.helper = DaemonThreadPool(1, thread_name_prefix="ragen-env")
            self._helpers.append(helper)
        future = helper.submit(fn, *args, **kwargs)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            helper.shutdown(wait=False)
            self._local.helper = None
            raise EnvTimeout(f"env call {getattr(fn, '__name__', fn)} took longer than {self.timeout_s} s") from None

    def close(self) -> None:
        for helper in self._helpers:
            helper.shutdown(wait=False)


class EnvThreads:
    """Runs env work for a list of episodes: one after another, except the episodes
    of a tag with ``env_threads > 1`` (RAGEN's ``parallel_friendly`` with
    ``max_workers``), which run at once on that many threads.

    Each job touches only its own episode and env, so running them at once never
    changes a result. A job's exception is raised after every job of the call
    has ended, the first in episode order, so no env is still stepping when the
    caller handles it.
    """

    def __init__(self) -> None:
        self._executors: dict[int, DaemonThreadPool] = {}  # by thread count

    def run(self, jobs: list[tuple[Episode, Any]]) -> None:
        by_tag: dict[str, list[Any]] = defaultdict(list)
        for episode, job in jobs:
            if episode.spec.env_threads > 1:
                by_tag[episode.spec.tag].append((episode, job))
            else:
                job()
        futures = []
        for tag_jobs in by_tag.values():
            if len(tag_jobs) == 1:
                tag_jobs[0][1]()
                continue
            n = tag_jobs[0][0].spec.env_threads
            executor = self._executors.get(n)
            if executor is None:
                executor = DaemonThreadPool(n, thread_name_prefix="ragen-envs")
                self._executors[n] = executor
            futures += [executor.submit(job) for _, job in tag_jobs]
        # Bounded: each job is one env call sequence, itself bounded by
        # env_timeout_s when set (the call runs on the EnvCaller's thread).
        concurrent.futures.wait(futures)
        for f in futures:
            f.result()

    def close(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=False)  # every job has ended: run() waits for them


def guard(episode: Episode, stats: LoopStats, isolate: bool, config: LoopConfig, call: EnvCaller,
          fn: Callable[..., T], *args: Any, answer: Completion | None = None) -> T | None:
    """``fn(*args)`` for one env, its result; when the env raises or times out, it is
    retried up to ``config.env_retries`` times on a fresh instance brought to where
    the failed one was (``_rebuild``), then ends its own episode in ``error``/``timeout``
    (None; or raises ``EnvError`` when not ``isolate``). ``answer``: the answer ``fn``
    applies, if any: a fresh instance must show what the failed one showed before it,
    and an answer whose turn is lost is kept for a replay (``failed_response``)."""
    if not episode.active:
        return None
    saved = (episode.observation, episode.actions_left)
    for attempt in range(config.env_retries + 1):
        try:
            if attempt:
                _rebuild(episode, call, expect=saved[0] if answer is not None else None)
                if fn is reset:  # the rebuild was the reset
                    return None
            return fn(*args)
        except (Exception, EnvTimeout) as exc:  # an env's own code failed
            episode.observation, episode.actions_left = saved
            episode.env = None  # a failed env's state is unknown: never reuse it
            message = f"{type(exc).__name__}: {exc}"
            if attempt < config.env_retries:
                with _ERRORS_LOCK:
                    stats.env_retries += 1
                logger.warning("%s failed at turn %d: %s; retrying on a fresh instance (%d of %d)",
                               describe(episode), len(episode.traj.turns), message, attempt + 1, config.env_retries)
                continue
            logger.debug("%s", traceback.format_exc())
            if answer is not None:
                episode.traj.failed_response = answer.text
            # the loop's limit, or the env's own (a remote env's)
            timed_out = isinstance(exc, (EnvTimeout, TimeoutError))
            end_in_error(episode, StopReason.TIMEOUT if timed_out else StopReason.ERROR, stats, isolate, cause=exc,
                         message=message)
            return None
    return None


def describe(episode: Episode) -> str:
    """The env as log lines and errors name it."""
    return f"env_id {episode.spec.env_id} (tag {episode.spec.tag}, seed {episode.spec.seed})"


def end_in_error(episode: Episode, reason: StopReason, stats: LoopStats, isolate: bool, cause: BaseException | None,
                  message: str) -> None:
    """The env ends its trajectory with ``reason`` (error or timeout) and
    ``message``, counted in ``stats``; when not ``isolate``, ``EnvError``
    instead."""
    where = describe(episode)
    with _ERRORS_LOCK:  # envs of a parallel_friendly tag fail on several threads at once
        stats.env_errors += 1
    if not isolate:
        raise EnvError(f"{where}: {message}") from cause
    logger.warning("%s ended in %s at turn %d: %s", where, reason.value, len(episode.traj.turns), message)
    episode.finish(reason, message)


def _rebuild(episode: Episode, call: EnvCaller, expect: str | None) -> None:
    """A fresh instance of the episode's env (not a kept one), reset with the
    same seed, with every recorded action stepped again; ``expect``: the
    observation the failed instance had shown, which the replay must give."""
    from ragen.env import make_env

    spec = episode.spec
    episode.env = make_env(spec.env_type, spec.env_config, config_type=spec.config_type, tag=spec.tag)
    reset_env(episode, call)
    for _ in _step_again(episode, call, episode.traj.turns):
        pass
    if expect is not None and episode.observation != expect:
        raise RuntimeError("replaying the recorded actions on a fresh instance gave another state than the failed "
                           "one had: the env is not deterministic for its seed, so it cannot be retried "
                           "(set agent_proxy.env_retries=0 for it)")


def _step_again(episode: Episode, call: EnvCaller, turns: Sequence[Turn]) -> Iterator[tuple[int, Step, Any, Any]]:
    """Every recorded step of ``turns`` taken again on the episode's env, its observation read: the
    turn's number, the step's record, and the reward and end the env gave this time."""
    for i, turn in enumerate(turns, 1):
        for step in turn.steps:
            obs, r, done, _ = call(episode.env.step, stepped_action(episode, step.action))
            episode.observation = checked_observation(obs, "step")
            yield i, step, r, done


def stepped_action(episode: Episode, name: str) -> Any:
    """What the env's ``step`` got for an executed action recorded as ``name``: its id in the
    env's lookup, a tool call's ``{"name", "arguments"}``, or the name itself."""
    if episode.spec.tools:
        return json.loads(name)
    return episode.lookup[name.lower()] if episode.lookup is not None else name


def reset(episode: Episode, kept_envs: KeptEnvs, call: EnvCaller) -> None:
    t0 = time.perf_counter()
    episode.env = kept_envs.acquire(episode.spec)
    reset_env(episode, call)
    episode.traj.reset_s = time.perf_counter() - t0


def resume(episode: Episode, kept_envs: KeptEnvs, call: EnvCaller) -> None:
    """A carried episode (``spec.resume``, cut short by an earlier rollout) brought back to where it
    stood: its env reset with its seed and every recorded action stepped again, each giving what it
    gave then (else the env is not deterministic for its seed: ``CarryDiverged``), and its turns
    taken over as they were (their answers, versions and log-probs)."""
    carried = episode.spec.resume
    reset(episode, kept_envs, call)
    steps = 0
    for i, step, r, done in _step_again(episode, call, carried.turns):
        # no bound: the recorded reward passed it when played; a reward that differs diverges
        if (episode.observation, checked_reward(r, math.inf, step_where(episode, i, steps + 1)), bool(done)) \
                != (step.observation, step.reward, step.done):
            raise CarryDiverged(
                f"stepping its recorded action {step.action!r} again (turn {i}) gave another observation, reward "
                f"or end than it did: the env is not deterministic for its seed, so its episode cannot be carried "
                f"to the next rollout (set agent_proxy.unfinished=abort)")
        steps += 1
    episode.traj.turns = list(carried.turns)  # once all of them replayed: a retry starts from the reset
    episode.actions_left -= steps
    episode.traj.success = carried.success


class CarryDiverged(RagenError, RuntimeError):
    """A carried episode's env, stepped again, did not give what it gave the first time."""


def reset_env(episode: Episode, call: EnvCaller) -> None:
    """The episode's env reset with its seed (and its mode, where ``reset`` takes one); its
    observation and action lookup read."""
    kwargs = {"mode": episode.spec.mode} if reset_takes_mode(type(episode.env)) else {}
    episode.observation = checked_observation(call(episode.env.reset, seed=episode.spec.seed, **kwargs), "reset")
    lookup = action_lookup(episode.env)
    if lookup:
        episode.traj.action_names = [str(v) for v in lookup.values()]
        episode.lookup = {str(v).lower(): k for k, v in lookup.items()}


def checked_observation(obs: Any, method: str) -> str:
    """``obs`` as the loop takes it: text, never ``str()`` of another object (the model would see its repr)."""
    if not isinstance(obs, str):
        raise EnvOutputError(f"{method} returned an observation of type {type(obs).__name__} "
                             f"({reprlib.repr(obs)}), not str: return the text the agent sees (e.g. self.render())")
    return obs


def step_where(episode: Episode, turn: int, step: int) -> str:
    """A step as a reward error names it: the env's tag, the step's number in the episode and its turn."""
    return f"tag {episode.spec.tag}, step {step} of the episode, turn {turn}"
