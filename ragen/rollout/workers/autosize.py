"""``agent_proxy.parallel_n_jobs: auto``: workers and pipeline depth sized
from the rollout itself.

After each rollout the parallel manager measures what the workers did and
what the engine did, and picks for the next rollout the number of workers
(1 to the cores available) and the pipeline depth that come closest to the
ideal floor. The model, from the last rollout's measurements:

    T(W) = G + B * s(W) / W + k * W

- ``G``: engine time (the engine is one, in the driver: workers cannot
  shorten it; every turn's prompts need the last turn's answers).
- ``B``: the workers' busy time, summed (their wall time less the time they
  waited for answers: env resets and steps, prompts, parsing), which ``W``
  workers share.
- ``s(W) = max(1, (W + 1) / cores)``: the workers and the driver (it serves
  every message) share the cores; past them, each worker's work stretches.
- ``k``: what one more worker costs per rollout (its messages' transit,
  measured: ``overhead/ipc_s``, at least ``MIN_PER_WORKER_S``).

This is the lockstep case (the engine waits while workers step), an upper
bound when streams overlap; it is the case where the worker count matters
most. Depth: one chunk per worker to start when the engine dominates
(``G >= B * s / W``: each turn is then one engine call over every env,
fewer messages), two otherwise (a worker resets and steps one chunk while
the engine answers the other). The first rollout, with nothing measured,
runs on every core at the configured depth. A later rollout keeps the last
worker count unless another is predicted ``SWITCH_GAIN`` faster: two counts
predicted within the noise of one rollout's measurements had alternated from
rollout to rollout (the overhead preset: 1, 2, 1, 1, 2...). Each choice, its
inputs and the reason are logged and returned as ``auto/*`` metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MIN_PER_WORKER_S = 0.0005
SWITCH_GAIN = 0.05  # another worker count must be predicted this much faster than the current one


@dataclass(frozen=True)
class Measured:
    """One rollout, as the parallel manager saw it."""

    engine_s: float  # G
    busy_s: float  # B: the workers' wall time less their waits for answers, summed
    ipc_s: float  # a worker's messages in transit, mean over workers
    workers: int  # workers the rollout ran on


@dataclass(frozen=True)
class Choice:
    """The workers and pipeline depth ``parallel_n_jobs: auto`` chose for the next rollout, with its
    prediction and reason."""

    workers: int
    depth: int | None  # None: the configured pipeline_depth
    predicted_s: float | None = None
    reason: str = ""

    def metrics(self) -> dict[str, float]:
        m = {"auto/workers": float(self.workers)}
        if self.depth is not None:
            m["auto/pipeline_depth"] = float(self.depth)
        if self.predicted_s is not None:
            m["auto/predicted_s"] = self.predicted_s
        return m


def stretch(workers: int, cores: int) -> float:
    """``s(W)``: how much longer a worker's work takes with the driver and ``workers`` workers on ``cores``."""
    return max(1.0, (workers + 1) / cores)


def predicted_s(m: Measured, workers: int, cores: int) -> float:
    per_worker = max(MIN_PER_WORKER_S, m.ipc_s)
    return m.engine_s + m.busy_s * stretch(workers, cores) / workers + per_worker * workers


def choose(m: Measured, cores: int, current: int | None = None) -> Choice:
    """The workers (1..cores) with the least predicted wall time (the fewest on a tie),
    or ``current`` unless that is ``SWITCH_GAIN`` slower; and the depth."""
    cores = max(1, cores)
    times = {w: predicted_s(m, w, cores) for w in range(1, cores + 1)}
    workers = min(times, key=lambda w: (round(times[w], 6), w))
    if current in times and times[workers] * (1 + SWITCH_GAIN) >= times[current]:
        workers = current
    engine_bound = m.engine_s >= m.busy_s * stretch(workers, cores) / workers
    depth = 1 if engine_bound else 2
    shown = ", ".join(f"{w}: {t:.3f} s" for w, t in times.items() if w in (1, 2, workers, cores))
    reason = (f"engine {m.engine_s:.3f} s, worker CPU {m.busy_s:.3f} s over {m.workers} worker(s), "
              f"transit {max(MIN_PER_WORKER_S, m.ipc_s) * 1000:.1f} ms a worker, {cores} cores; predicted "
              f"{shown}; depth {depth}: "
              + ("the engine dominates, one call per turn over every env" if engine_bound
                 else "env work dominates, a chunk steps while another waits for the model"))
    return Choice(workers, depth, times[workers], reason)


class AutoSizer:
    """The choice for the next rollout, updated after each (not thread-safe:
    rollouts at once share the last choice and update it in turn)."""

    def __init__(self, cores: int) -> None:
        self.cores = max(1, cores)
        self.choice = Choice(self.cores, None, None, "first rollout: nothing measured yet, every core")

    def update(self, m: Measured) -> Choice:
        self.choice = choose(m, self.cores, current=m.workers)
        logger.info("[Auto] next rollout: %d worker(s), pipeline depth %d (%s)",
                    self.choice.workers, self.choice.depth, self.choice.reason)
        return self.choice
