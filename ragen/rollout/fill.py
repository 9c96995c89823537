"""A training batch of whole groups of signal, and envs that keep failing set aside.

- ``group_drops(trajectories, rollout_filter)``: the groups a training batch
  leaves out, and why: ``failed`` (an env of the group ended in error or
  timeout after its retries: a group with a hole is never trained, as
  tinker-cookbook's rule has it) or ``no_signal`` (``rollout_filter:
  nonzero_variance``, and the group's rewards all agree: GRPO learns nothing
  from it).
- ``fill_batch(first, play, maker, rollout_filter, max_refill)``: the first
  rollout, then up to ``max_refill`` rounds that play a fresh group for each
  dropped one (the same tag, a seed set aside for refills), until the batch holds
  ``env_groups`` kept groups (DAPO's dynamic sampling). The dropped groups stay
  in the result (metrics, dumps), named in ``RolloutResult.dropped_groups``.
- ``Quarantine``: a (tag, seed) that ended in error in ``after`` consecutive
  rollouts of a split is not dealt for ``rollouts`` rollouts; the maker gives
  its group the next seed that is free (``EnvSpec.replaces_seed`` records the
  one it replaced).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from ragen.rollout.envs import compute_metrics
from ragen.rollout.types import EnvSpec, RolloutResult, StopReason, Trajectory
from ragen.rollout.workers.schedule import groups_of

logger = logging.getLogger(__name__)

FAILED, NO_SIGNAL = "failed", "no_signal"


def group_drops(trajectories: Sequence[Trajectory], rollout_filter: str) -> dict[int, str]:
    """group id -> why a training batch leaves the group out (``FAILED`` or ``NO_SIGNAL``)."""
    drops = {}
    for trajs in groups_of(trajectories):
        if any(t.stop_reason.failed for t in trajs):
            drops[trajs[0].group_id] = FAILED
        elif rollout_filter == "nonzero_variance" and len({t.reward for t in trajs}) == 1:
            drops[trajs[0].group_id] = NO_SIGNAL
    return drops


def fill_batch(first: RolloutResult, play: Callable[[list[EnvSpec]], RolloutResult], maker,
               rollout_filter: str, max_refill: int) -> RolloutResult:
    """``first`` (a training rollout of ``maker``'s env set), with up to ``max_refill`` rounds of
    fresh groups, of the dropped ones' tags, played by ``play``."""
    trajectories, specs = list(first.trajectories), list(first.specs)
    tag_of = {s.group_id: s.tag for s in specs}
    already = dict(first.dropped_groups)  # left out before the filter (an over-sampled rollout's aborted groups)
    drops = {g: why for g, why in group_drops(trajectories, rollout_filter).items() if g not in already}
    pending = sorted(drops)
    rounds, refill_s = 0, 0.0
    while pending and rounds < max_refill:
        t0 = time.perf_counter()
        first_id = max(tag_of) + 1
        extra = maker.refill_specs([tag_of[g] for g in pending], first_id)
        tag_of.update({first_id + k: tag_of[g] for k, g in enumerate(pending)})
        result = play(extra)
        new = group_drops(result.trajectories, rollout_filter)
        drops.update(new)
        trajectories += result.trajectories
        specs += result.specs
        pending = sorted(new)
        rounds += 1
        refill_s += time.perf_counter() - t0
    n_groups = len(tag_of)
    kept = n_groups - len(drops) - len(already)
    metrics = dict(first.metrics)
    if rounds:  # over every group played to its end (not those over-sampling left out before)
        metrics.update(compute_metrics([t for t in trajectories if t.group_id not in already]))
    metrics.update({
        "fill/groups_sampled": float(n_groups),
        "fill/groups_kept": float(kept),
        "fill/dropped_failed": float(sum(r == FAILED for r in drops.values())),
        "fill/dropped_no_signal": float(sum(r == NO_SIGNAL for r in drops.values())),
        "fill/refill_rounds": float(rounds),
        "fill/refill_s": refill_s,
        # the groups a full batch still lacks after max_refill rounds
        "fill/groups_missing": float(max(0, maker.env_groups - kept)),
    })
    order = sorted(range(len(trajectories)), key=lambda i: trajectories[i].env_id)
    return RolloutResult(trajectories=[trajectories[i] for i in order], specs=[specs[i] for i in order],
                         metrics=metrics, dropped_groups={**already, **drops})


class Quarantine:
    """Which (tag, seed) of a split are set aside, and for how long (see the module docstring)."""

    def __init__(self, after: int, rollouts: int, split: str) -> None:
        self.after = after
        self.rollouts = rollouts
        self.split = split
        self._failed: dict[tuple[str, int], int] = {}  # consecutive rollouts that ended the key in error
        self._until: dict[tuple[str, int], int] = {}  # held while fewer rollouts than this were recorded
        self._recorded = 0
        self._lock = threading.Lock()

    def holds(self, tag: str, seed: int) -> bool:
        until = self._until.get((tag, seed))
        return until is not None and self._recorded < until

    @property
    def held(self) -> list[tuple[str, int]]:
        """The (tag, seed) set aside now."""
        with self._lock:
            return sorted(k for k, until in self._until.items() if self._recorded < until)

    def record(self, trajectories: Sequence[Trajectory]) -> None:
        """One rollout of the split: a key each of whose plays ended in error counts one more;
        any other play of it starts its count again."""
        errors: dict[tuple[str, int], str | None] = {}
        for t in trajectories:
            key = (t.tag, t.seed)
            if t.stop_reason == StopReason.ERROR:
                errors[key] = t.error or "(no error text)"
            else:
                errors.setdefault(key, None)
        with self._lock:
            self._recorded += 1
            for key, error in errors.items():
                if error is None:
                    self._failed.pop(key, None)
                    continue
                self._failed[key] = count = self._failed.get(key, 0) + 1
                if count >= self.after:
                    del self._failed[key]
                    self._until[key] = self._recorded + self.rollouts
                    logger.warning("%s env tag %s, seed %d ended in error in %d rollouts in a row: quarantined "
                                   "for the next %d rollouts (its group plays another seed); last error: %s",
                                   self.split, key[0], key[1], count, self.rollouts, error)
