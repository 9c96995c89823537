"""``RolloutBackend``: the one interface of a rollout, and what the synchronous backends share.

A backend plays env specs to a ``RolloutResult``: ``rollout(specs, loop)``.
``specs`` is either the list of specs to play, or the env set of a split
(``EnvSpecMaker``), whose next batch the backend draws: the synchronous
backends draw it when called, the asynchronous ones ahead of the caller.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from typing import Any, Iterator, Sequence

from ragen.llm.stats import EngineStats
from ragen.llm.types import Engine
from ragen.rollout.envs import EnvSpecMaker
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.progress import RolloutProgress
from ragen.rollout.types import EnvSpec, RolloutResult
from ragen.serving.gate import EngineGate

logger = logging.getLogger(__name__)

Specs = Sequence[EnvSpec] | EnvSpecMaker


class RolloutBackend(ABC):
    """Plays env specs to trajectories; sequential, parallel, generate-ahead and
    fully-async are its implementations, built by ``make_backend``.

    - ``rollout(specs, loop, progress=, policy_version=, enough=)``: a
      list of specs is played as given; an env set gives its next batch (which
      an asynchronous backend may have played ahead, with older weights:
      ``policy_version`` is the trainer's, to bound that). ``enough``: a
      synchronous rollout of a list ends once that many groups ended whole
      (none of their envs in error or timeout), the episodes still playing
      ``aborted`` (over-sampling, ``ragen.rollout.oversample``).
    - ``engine_lock``: held around every engine call; the trainer holds it to
      change the weights.
    - ``paused()``: no generation in the background inside (validation).
    - ``metrics()``: what the backend counts across rollouts (asynchronous modes).
    - ``close()``: stops its threads and workers.
    """

    serving: Any = None  # the SharedLLMInferenceManager the backend's workers talk to, if any

    @abstractmethod
    def rollout(self, specs: Specs, loop: LoopConfig, *, progress: RolloutProgress | None = None,
                policy_version: int = 0, enough: int | None = None) -> RolloutResult:
        ...

    @property
    @abstractmethod
    def engine_lock(self) -> EngineGate:
        ...

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        yield

    def metrics(self) -> dict[str, float]:
        return {}

    @abstractmethod
    def close(self) -> None:
        ...

    def __enter__(self) -> "RolloutBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SyncBackend(RolloutBackend):
    """A backend that plays a rollout when called (sequential, parallel).

    Around each rollout: at most ``max_concurrent_rollouts`` at once, a
    progress display (a bar on a terminal, log lines elsewhere), the engine's
    prompt-token counts, its per-episode caches freed once no rollout runs,
    and one summary line. Subclasses play the specs in ``_play``. ``serving``:
    the shared manager its episodes ask, if any; with ``owns_serving``
    (``make_backend`` built it for this backend), ``close()`` stops it last.
    """

    engine: Engine
    keeps_episodes = False  # episodes run outside ``rollout`` (fully-async groups): the engine keeps their caches

    def __init__(self, max_concurrent_rollouts: int | None = None, serving: Any = None,
                 owns_serving: bool = False) -> None:
        self.serving = serving
        self._owned_serving = serving if owns_serving else None
        self._semaphore = (threading.BoundedSemaphore(max_concurrent_rollouts) if max_concurrent_rollouts
                           else contextlib.nullcontext())
        self._running = 0
        self._running_lock = threading.Lock()

    @abstractmethod
    def _play(self, specs: Sequence[EnvSpec], loop: LoopConfig, progress: RolloutProgress,
              enough: int | None = None) -> RolloutResult:
        ...

    def _close_owned(self) -> None:
        """The end of ``close()``: the shared manager built for this backend stops after its workers."""
        serving, self._owned_serving = self._owned_serving, None
        if serving is not None:
            serving.close()

    def rollout(self, specs: Specs, loop: LoopConfig, *, progress: RolloutProgress | None = None,
                policy_version: int = 0, enough: int | None = None) -> RolloutResult:
        label = progress.split if progress is not None else "rollout"
        if isinstance(specs, EnvSpecMaker):
            label, specs = specs.split, specs.make_specs()
        with self._semaphore:  # the bar's clock starts once the rollout may run
            with self._running_lock:
                self._running += 1
            try:
                # the engine's counts over this rollout (rollouts at once, or generating ahead, add theirs)
                before = self.engine.stats()
                with progress if progress is not None else RolloutProgress(len(specs), label) as shown:
                    # the answers of a long engine call grow before it returns
                    shown.watch_tokens(lambda: self.engine.stats().tokens_sampled - before.tokens_sampled)
                    result = self._play(specs, loop, shown, enough)
                after = self.engine.stats()
                counts = _engine_counts(before, after)
                cache_mb = after.turn_cache_bytes / 2**20 if after.turn_cache_bytes is not None else None
            finally:
                with self._running_lock:
                    self._running -= 1
                    # every episode of this rollout has ended: unless another rollout or the
                    # fully-async groups still run episodes, nothing the engine keeps is needed
                    if self._running == 0 and not self.keeps_episodes:
                        self.engine.release_cache()
        m = result.metrics
        prefilled, reused = counts.pop("engine/prefill_tokens"), counts.pop("engine/reused_tokens")
        if prefilled or reused:
            m.update({"engine/prefill_tokens": prefilled, "engine/reused_tokens": reused,
                      "engine/prefix_reuse": reused / (prefilled + reused)})
        evicted = counts.pop("engine/turn_cache_evicted")
        if cache_mb is not None:  # the memory kept for next turns, and the episodes let go to stay in bound
            m.update({"engine/turn_cache_mb": cache_mb, "engine/turn_cache_evicted": evicted})
        later, returned = counts.pop("engine/replica_later_turns", 0.0), counts.pop("engine/replica_returned", 0.0)
        if later:  # the share of later turns that went back to their episode's replica
            m["engine/replica_affinity"] = returned / later
        # the counts that remain (history divergences, token prompts sent as messages, each replica's
        # use) say something at zero too: an engine that took every prompt as the ids sampled
        m.update(counts)
        _log_summary(label, result)
        return result


class AsyncBackend(RolloutBackend):
    """A backend that generates the training batches of one env set ahead of
    the trainer (generate-ahead, fully-async); a list of specs (validation) is
    played by ``inner``, the synchronous backend it generates with."""

    def __init__(self, inner: SyncBackend) -> None:
        self.inner = inner
        self.serving = inner.serving
        self._source: tuple[EnvSpecMaker, LoopConfig] | None = None

    @property
    def engine_lock(self) -> EngineGate:
        return self.inner.engine_lock

    @abstractmethod
    def _next_batch(self, envs: EnvSpecMaker, loop: LoopConfig, policy_version: int,
                    progress: RolloutProgress | None) -> RolloutResult:
        """The next training batch of ``envs``."""

    def rollout(self, specs: Specs, loop: LoopConfig, *, progress: RolloutProgress | None = None,
                policy_version: int = 0, enough: int | None = None) -> RolloutResult:
        if not isinstance(specs, EnvSpecMaker):
            return self.inner.rollout(specs, loop, progress=progress, enough=enough)
        if enough is not None:
            raise ValueError(f"{type(self).__name__} generates whole batches: over-sampling (enough={enough}) "
                             "cuts the tail of a synchronous rollout")
        if self._source is None:
            self._source = (specs, loop)
        elif self._source[0] is not specs or self._source[1] != loop:
            raise ValueError(f"{type(self).__name__} generates the batches of one env set and loop config; it was "
                             f"given env set {specs.split!r} after {self._source[0].split!r}")
        return self._next_batch(specs, loop, policy_version, progress)

    def close(self) -> None:
        self.inner.close()


def _engine_counts(before: EngineStats, after: EngineStats) -> dict[str, float]:
    """The engine's counts over a rollout, under their metric names (``EngineStats.counts``): prompt
    tokens computed and reused, the episodes its turn cache evicted, the appended prompts whose
    template rewrote history, the requests sent as messages where token ids were meant, and with
    replicas, each one's requests, tokens, calls and busy time, the failovers and the later turns
    routed back to their episode's replica (``Router.counts``)."""
    earlier = before.counts()
    return {key: value - earlier.get(key, 0.0) for key, value in after.counts().items()}


def _replica_part(m: dict[str, float]) -> str:
    """With replicas: their failovers (0 too), and the later turns that went back to their episode's
    replica where there were later turns."""
    if "engine/replica_failovers" not in m:
        return ""
    affinity = (f"{m['engine/replica_affinity']:.0%} of later turns on their episode's, "
                if "engine/replica_affinity" in m else "")
    return f" | replicas: {affinity}{int(m['engine/replica_failovers'])} failovers"


def _log_summary(label: str, result: RolloutResult) -> None:
    m = result.metrics
    logger.info(
        # env and waiting time add up every worker's, so with several workers they pass the rollout's wall time
        "[Rollout] %s: %d envs in %.2f s | engine %.2f s, %d calls, mean batch %.1f%s | summed over workers: "
        "env %.2f s, waiting for the model %.2f s | fallbacks %d%s | success %.3f",
        label, len(result.specs), m.get("timing/rollout_s", 0.0), m.get("timing/engine_s", 0.0),
        int(m.get("engine/calls", 0)), m.get("engine/mean_batch_size", 0.0),
        f", prompt tokens {m['engine/prefix_reuse']:.0%} reused" if "engine/prefix_reuse" in m else "",
        m.get("timing/env_s", 0.0), m.get("timing/wait_llm_s", 0.0), int(m.get("parallel/fallbacks", 0)),
        _replica_part(m),
        m.get("rollout/success", 0.0))
    for f in result.failed_envs:
        logger.warning("[Rollout] %s: env_id %d (tag %s, seed %d) ended in %s at turn %d: %s | check it alone: %s",
                       label, f["env_id"], f["tag"], f["seed"], f["stop_reason"], f["turn"], f["error"], f["check"])
