"""Generate-ahead: training rollouts generated while the trainer trains.

- ``GenerateAhead`` (``async_generation_ratio: k > 0``): the backend. The
  next batch of the train env set comes from ``RolloutAhead`` over the
  synchronous backend; a list of specs (validation) is played by that
  backend directly.
- ``RolloutAhead`` (``async_generation_ratio: k``): a background thread keeps
  generating training rollouts while the trainer trains, at most ``k`` batches
  ahead (generating or waiting to be trained on). ``get(version)`` hands the
  trainer the oldest batch; a batch more than ``k`` policy versions older than
  ``version`` is dropped and counted, never trained on. ``paused()`` stops new
  generation while validation runs. ``k = 0`` is no thread at all: the
  synchronous pipeline. A rollout that raises stops the background
  generation: ``get`` hands out the batches made before it, then raises that
  error, and raises it again on every later call (no batch follows a failed
  one: the trainer decides whether to go on, with a new ``RolloutAhead``).
  After ``close()``, ``get`` hands out what was made, then raises
  ``RuntimeError``: it never blocks for good.
- Staleness of a batch is ``version - min(policy versions of its turns)``;
  ``StalenessBound`` drops and counts what is more than its bound old.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from ragen.rollout.backends.base import AsyncBackend, SyncBackend
from ragen.rollout.envs import EnvSpecMaker
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.progress import RolloutProgress
from ragen.rollout.types import RolloutResult

logger = logging.getLogger(__name__)


def response_tokens(trajectories) -> int:
    """The tokens the engine generated for ``trajectories`` (what a dropped or restarted group throws away)."""
    return sum(len(t.response_ids) for tr in trajectories for t in tr.turns)


def staleness(trajectories, version: int) -> int:
    """How many policy versions behind ``version`` the oldest answer in ``trajectories`` is."""
    versions = [t.policy_version for tr in trajectories for t in tr.turns]
    return version - min(versions) if versions else 0


class StalenessBound:
    """Admits what is at most ``bound`` policy versions old; drops and counts the rest."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.dropped = 0
        self.tokens_dropped = 0
        self.staleness: list[int] = []  # of each batch or group admitted

    def admit(self, trajectories, version: int, drop: bool = True) -> bool:
        """Whether to train on ``trajectories`` at ``version``; ``drop=False``
        admits whatever its age (partial rollouts), only recording it."""
        lag = staleness(trajectories, version)
        if drop and lag > self.bound:
            self.dropped += 1
            self.tokens_dropped += response_tokens(trajectories)
            return False
        self.staleness.append(lag)
        return True

    def metrics(self) -> dict[str, float]:
        m = {"async/dropped_stale": float(self.dropped), "async/tokens_dropped": float(self.tokens_dropped)}
        if self.staleness:
            m["async/staleness_mean"] = sum(self.staleness) / len(self.staleness)
            m["async/staleness_max"] = float(max(self.staleness))
        return m


@dataclass
class AheadStats:
    """Where generate-ahead's time went: the trainer waiting for data, generation waiting for the
    trainer, and the batches made."""

    trainer_wait_s: float = 0.0  # the trainer waiting for data
    generator_wait_s: float = 0.0  # generation waiting for the trainer (k batches ahead, or paused)
    produced: int = 0


class RolloutAhead:
    """Rollouts made by ``produce`` in a background thread, at most ``ahead``
    (``async_generation_ratio``, checked by the config reader) waiting for the
    trainer; see the module docstring."""

    def __init__(self, produce: Callable[[], RolloutResult], ahead: int) -> None:
        self.produce = produce
        self.ahead = ahead
        self.stats = AheadStats()
        self.bound = StalenessBound(ahead)
        self._ready: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(ahead)
        self._running = threading.Event()
        self._running.set()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._failure: BaseException | None = None  # what stopped the generation, once handed out
        self._thread: threading.Thread | None = None
        if ahead > 0:
            self._thread = threading.Thread(target=self._loop, name="ragen-rollout-ahead", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            while not self._slots.acquire(timeout=0.1):
                if self._stop.is_set():
                    return
            while not self._running.wait(timeout=0.1):
                if self._stop.is_set():
                    self._slots.release()
                    return
            self.stats.generator_wait_s += time.perf_counter() - t0
            self._idle.clear()
            try:
                if not self._running.is_set():  # paused between the check and here
                    self._slots.release()
                    continue
                result = self.produce()
                self.stats.produced += 1
                self._ready.put(result)
            except BaseException as exc:  # hand the failure to the trainer
                self._ready.put(exc)
                return
            finally:
                self._idle.set()

    def get(self, version: int) -> RolloutResult:
        """The next batch no more than ``ahead`` versions old."""
        while True:
            if self.ahead == 0:
                result = self.produce()
                self.stats.produced += 1
            else:
                t0 = time.perf_counter()
                result = self._next_ready()
                self.stats.trainer_wait_s += time.perf_counter() - t0
            if not self.bound.admit(result.trajectories, version):
                logger.warning("dropped a rollout %d policy versions old (async_generation_ratio=%d)",
                               staleness(result.trajectories, version), self.ahead)
                continue
            return result

    def _next_ready(self) -> RolloutResult:
        """The oldest batch made; the failure that stopped the generation once
        the batches before it are handed out."""
        while True:
            try:
                # bounded, to notice a generator that stopped (failed or closed)
                item = self._ready.get(timeout=0.1)
            except queue.Empty:
                if self._failure is not None:
                    raise self._failure
                thread = self._thread
                if thread is None or not thread.is_alive():
                    if self._ready.empty():  # not a batch put just before the thread ended
                        raise RuntimeError("RolloutAhead is closed: no more rollouts are generated")
                continue
            self._slots.release()
            if isinstance(item, BaseException):
                self._failure = item
                raise item
            return item

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No new generation inside (validation runs here); the rollout in
        progress, if any, finishes first."""
        self._running.clear()
        self._idle.wait()  # the rollout in progress: bounded as every rollout is (its timeouts)
        try:
            yield
        finally:
            self._running.set()

    def close(self) -> None:
        self._stop.set()
        self._running.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None


class GenerateAhead(AsyncBackend):
    """``async_generation_ratio: k > 0``: the train env set's batches generated
    up to ``k`` ahead of the trainer by ``inner`` (sequential or parallel),
    none trained on more than ``k`` policy versions old; lists of specs are
    played by ``inner`` at once."""

    def __init__(self, inner: SyncBackend, ahead: int) -> None:
        super().__init__(inner)
        self.ahead = ahead
        self._rollouts: RolloutAhead | None = None

    def _next_batch(self, envs: EnvSpecMaker, loop: LoopConfig, policy_version: int,
                    progress: RolloutProgress | None) -> RolloutResult:
        if self._rollouts is None:
            self._rollouts = RolloutAhead(lambda: self.inner.rollout(envs, loop), self.ahead)
        return self._rollouts.get(policy_version)

    @contextmanager
    def paused(self) -> Iterator[None]:
        if self._rollouts is None:
            yield
            return
        with self._rollouts.paused():
            yield

    def metrics(self) -> dict[str, float]:
        if self._rollouts is None:
            return {}
        st = self._rollouts.stats
        m = {"async/trainer_wait_s": st.trainer_wait_s, "async/generator_wait_s": st.generator_wait_s,
             "async/produced": float(st.produced)}
        m.update(self._rollouts.bound.metrics())
        return m

    def close(self) -> None:
        if self._rollouts is not None:
            self._rollouts.close()
        super().close()
