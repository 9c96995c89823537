"""The metrics of one rollout, under stable names, whichever backend played it.

``rollout_metrics`` builds what every backend reports: the trajectories'
outcomes (``rollout/*``, ``compute_metrics``), where the time went
(``timing/*``) and how the engine was used (``engine/*``). A backend adds the
metrics only it has (the parallel backend's ``parallel/*``, ``ipc/*`` and
``overhead/*``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ragen.rollout.envs import compute_metrics
from ragen.rollout.loop_config import LoopStats
from ragen.rollout.types import Trajectory


@dataclass(frozen=True)
class EngineUse:
    """The engine calls of one rollout: how many, the requests they answered,
    the time they took, and the size of each."""

    calls: int = 0
    requests: int = 0
    time_s: float = 0.0
    batch_sizes: Sequence[int] = field(default_factory=tuple)


def rollout_metrics(trajectories: Sequence[Trajectory], stats: LoopStats, engine: EngineUse,
                    fallbacks: int, wall_s: float) -> dict[str, float]:
    """Outcomes, timings and engine use of one rollout; ``stats`` summed over
    everything that played its envs, ``fallbacks``: the workers whose groups
    were re-run by the fallback."""
    m = compute_metrics(trajectories)
    sizes = list(engine.batch_sizes)
    m.update({
        "timing/env_reset_s": stats.env_reset_s,
        "timing/env_step_s": stats.env_step_s,
        "timing/env_s": stats.env_reset_s + stats.env_step_s,
        "timing/wait_llm_s": stats.wait_s,
        "timing/engine_s": engine.time_s,
        "engine/calls": float(engine.calls),
        "engine/requests": float(engine.requests),
        "engine/mean_batch_size": sum(sizes) / len(sizes) if sizes else 0.0,
        "engine/max_batch_size": float(max(sizes)) if sizes else 0.0,
        "parallel/fallbacks": float(fallbacks),
        "rollout/env_retries": float(stats.env_retries),
        # from the first env's end to the last's: the tail a rollout waits through
        "timing/envs_done_spread_s": stats.done_spread_s or 0.0,
        "timing/rollout_s": wall_s,
    })
    return m


def engine_idle(spans: Sequence[tuple[float, float]], start: float, end: float) -> dict[str, float]:
    """Where the engine sat idle during a rollout (exact when one rollout runs
    at a time): before its first call (envs resetting), between calls (workers
    stepping envs, messages), after its last (last steps, results returning)."""
    mine = [(a, b) for a, b in spans if a >= start]
    if not mine:
        return {}
    between = sum(max(0.0, mine[i + 1][0] - mine[i][1]) for i in range(len(mine) - 1))
    return {"timing/engine_idle_before_s": mine[0][0] - start,
            "timing/engine_idle_between_s": between,
            "timing/engine_idle_after_s": max(0.0, end - mine[-1][1])}
