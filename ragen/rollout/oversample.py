"""Over-sampling: a training rollout starts more groups than its batch needs and ends at enough.

APRIL's answer to the long tail (slime): ``agent_proxy.over_sample: f`` starts
``ceil(f x env_groups)`` groups and ends the rollout once ``env_groups`` of them
ended (``RolloutBackend.rollout(..., enough=)``: the scheduler counts the groups
ended whole, and every episode still playing then ends ``aborted``, its
request cancelled). Groups are in a batch whole or not at all; the unfinished
ones follow ``agent_proxy.unfinished``:

- ``carry``: they go on in the next rollout. Each member's trajectory so far
  travels in its spec (``EnvSpec.resume``): the env is reset with its seed and
  its recorded actions stepped again (an env not deterministic for its seed
  ends in error, and its group is dropped as failed), its turns kept with the
  policy version and log-probs that sampled them (the trainer's off-policy
  correction reads them); the answer cut short is asked again. Carried groups
  keep their ids, and so their sampling seeds. One more than
  ``max_carry_staleness`` policy versions behind is dropped and counted.
- ``abort``: they are dropped (``RolloutResult.dropped_groups``: ``aborted``).
  The batch then holds the groups that end first: those with fewer turns and
  shorter answers. ``carry`` trains the slow ones too, a rollout later.

A batch holds ``env_groups`` groups: when more end together (an engine that
answers a turn's requests in one call), those past it, the latest dealt,
wait for the next batch, carried whole. ``OverSample.deal`` makes a
rollout's specs, ``OverSample.cut`` turns its result into the batch and
keeps what is carried; metrics ``oversample/*`` count the groups started,
resumed, finished, held over as surplus, carried, aborted and dropped as
stale, and the mean turns of an env in the finished groups against the
unfinished ones (the length bias ``abort`` brings). Validation never
over-samples.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from ragen.rollout.backends.ahead import response_tokens, staleness
from ragen.rollout.envs import EnvSpecMaker, compute_metrics, spec_of
from ragen.rollout.types import EnvSpec, RolloutResult, StopReason, Trajectory
from ragen.rollout.workers.schedule import groups_of

logger = logging.getLogger(__name__)

ABORTED = "aborted"  # why a batch leaves an unfinished group out (unfinished: abort)

Group = list[tuple[EnvSpec, Trajectory]]


class OverSample:
    """The over-sampled training rollouts of one env set, and the groups carried between them."""

    def __init__(self, factor: float, unfinished: str, max_staleness: int) -> None:
        self.factor = factor
        self.unfinished = unfinished
        self.max_staleness = max_staleness
        self.carried: list[Group] = []
        self._enough = 0  # the batch's groups (env_groups) of the rollout dealt last
        self._dealt: dict[str, float] = {}  # what deal counted, for the metrics of its rollout

    def state_dict(self) -> dict[str, list[list[dict[str, Any]]]]:
        """The groups carried to the next rollout, a checkpoint's: each env's tag, seed and ids and
        its trajectory so far (no env type or config: those are the resumed run's)."""
        return {"carried": [[{"tag": s.tag, "seed": s.seed, "env_id": s.env_id, "group_id": s.group_id,
                              "replaces_seed": s.replaces_seed, "trajectory": t} for s, t in group]
                            for group in self.carried]}

    def load_state_dict(self, state: dict[str, list[list[dict[str, Any]]]], maker: EnvSpecMaker) -> None:
        """The carried groups of ``state``, each env's spec made again from ``maker``'s config of its
        tag. A group of a tag ``maker`` does not play, or of another size than its ``group_size``
        (the resumed run changed ``es_manager.<split>.group_size``: its envs' ids would be dealt
        twice), is left out, with a warning. ValueError naming the entry
        (``over_sample.carried[g][m]``) where one is not what ``state_dict`` writes."""
        groups = state.get("carried") if isinstance(state, dict) else None
        if not isinstance(groups, list):
            raise ValueError(f"over_sample.carried: a list of groups expected, got {type(groups).__name__}")
        groups = [_read_group(group, f"over_sample.carried[{g}]") for g, group in enumerate(groups)]
        self.carried = []
        resized = [len(group) for group in groups if len(group) != maker.group_size]
        if resized:
            logger.warning("%d carried groups (of %s envs) are left out: es_manager.%s.group_size is %d",
                           len(resized), "/".join(str(n) for n in sorted(set(resized))), maker.split,
                           maker.group_size)
        for group in groups:
            tag = group[0]["tag"]
            if len(group) != maker.group_size:
                continue
            if tag not in maker.tag_specs:
                logger.warning("a carried group of tag %r (seed %d) is left out: es_manager.%s does not play the tag",
                               tag, group[0]["seed"], maker.split)
                continue
            self.carried.append([(spec_of(tag, maker.tag_specs[tag], m["seed"], env_id=m["env_id"],
                                          group_id=m["group_id"], mode=maker.split,
                                          replaces_seed=m["replaces_seed"]), m["trajectory"]) for m in group])

    def deal(self, maker: EnvSpecMaker, policy_version: int) -> list[EnvSpec]:
        """The next rollout's specs: the carried groups (those at most ``max_staleness`` versions
        behind ``policy_version``), then the env set's next batch, numbered after them, and fresh
        groups until ``ceil(factor x env_groups)`` play. Its ``enough`` is ``maker.env_groups``."""
        kept, stale, tokens = [], 0, 0
        for group in self.carried:
            trajectories = [t for _, t in group]
            if staleness(trajectories, policy_version) > self.max_staleness:
                stale += 1
                tokens += response_tokens(trajectories)
            else:
                kept.append(group)
        self.carried = []
        carried = [dataclasses.replace(spec, resume=traj) for group in kept for spec, traj in group]
        first = max((s.group_id for s in carried), default=-1) + 1
        fresh = [dataclasses.replace(s, env_id=s.env_id + first * maker.group_size, group_id=s.group_id + first)
                 for s in maker.make_specs()]
        extra = math.ceil(self.factor * maker.env_groups) - maker.env_groups - len(kept)
        if extra > 0:  # tags spread over the env set's slots, as its n_groups has them
            tags = [maker.group_tags[k * maker.env_groups // extra] for k in range(extra)]
            fresh += maker.refill_specs(tags, first + maker.env_groups)
        self._enough = maker.env_groups
        self._dealt = {"oversample/groups_resumed": float(len(kept)), "oversample/dropped_stale": float(stale),
                       "oversample/tokens_dropped_stale": float(tokens)}
        return carried + fresh

    def cut(self, result: RolloutResult) -> RolloutResult:
        """The batch of a rollout dealt by ``deal``: ``env_groups`` of its groups whose every env
        ended (those with one in error or timeout too: the batch drops them as failed), the
        lowest-numbered (the carried ones, older, first); the finished ones past that wait for
        the next batch (carried whole); the unfinished ones are carried (kept here, left out of
        the result) or named ``aborted``."""
        finished: list[Group] = []
        unfinished: list[Group] = []
        for group in groups_of(list(zip(result.specs, result.trajectories)), lambda m: m[0].group_id):
            reasons = {t.stop_reason for _, t in group}
            done = StopReason.ABORTED not in reasons or any(r.failed for r in reasons)
            (finished if done else unfinished).append(group)
        batch, surplus = finished[:self._enough], finished[self._enough:]
        keep = batch if self.unfinished == "carry" else batch + unfinished
        members = sorted((m for group in keep for m in group), key=lambda m: m[0].env_id)
        self.carried = surplus + (unfinished if self.unfinished == "carry" else [])
        metrics = dict(result.metrics)
        metrics.update(compute_metrics([t for group in batch for _, t in group]))  # over the batch's groups
        metrics.update(self._dealt)
        metrics.update({
            "oversample/groups_started": float(len(finished) + len(unfinished)),
            "oversample/groups_finished": float(len(finished)),
            # finished past env_groups: carried whole into the next batch
            "oversample/groups_surplus": float(len(surplus)),
            "oversample/groups_carried": float(len(unfinished) if self.unfinished == "carry" else 0),
            "oversample/groups_aborted": float(len(unfinished) if self.unfinished == "abort" else 0),
            # an env's turns in the groups that ended against those cut short (so far): the length bias
            "oversample/turns_finished": _mean_turns(finished),
            "oversample/turns_unfinished": _mean_turns(unfinished),
        })
        dropped = dict(result.dropped_groups)
        if self.unfinished == "abort":
            dropped.update({group[0][0].group_id: ABORTED for group in unfinished})
        return RolloutResult(trajectories=[t for _, t in members],
                             specs=[dataclasses.replace(s, resume=None) if s.resume is not None else s
                                    for s, _ in members],
                             metrics=metrics, dropped_groups=dropped)


def _mean_turns(groups: list[Group]) -> float:
    turns = [len(t.turns) for group in groups for _, t in group]
    return sum(turns) / len(turns) if turns else 0.0


# what state_dict writes of each carried env: its key, and the check of its value
_MEMBER_FIELDS = {
    "tag": lambda v: isinstance(v, str),
    "seed": lambda v: _is_int(v),
    "env_id": lambda v: _is_int(v),
    "group_id": lambda v: _is_int(v),
    "replaces_seed": lambda v: v is None or _is_int(v),
    "trajectory": lambda v: isinstance(v, Trajectory),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_group(group: Any, where: str) -> list[dict[str, Any]]:
    """One carried group of a checkpoint, checked: a list of its envs, each with every key of
    ``_MEMBER_FIELDS``, of one tag, seed and group id, its trajectory that env's."""
    if not isinstance(group, list) or not group:
        raise ValueError(f"{where}: a non-empty list of a group's envs expected, got "
                         f"{'no env' if isinstance(group, list) else type(group).__name__}")
    for m, member in enumerate(group):
        at = f"{where}[{m}]"
        if not isinstance(member, dict):
            raise ValueError(f"{at}: a dict of an env's tag, seed, ids and trajectory expected, got "
                             f"{type(member).__name__}")
        for key, valid in _MEMBER_FIELDS.items():
            if key not in member:
                raise ValueError(f"{at}: no {key!r}")
            if not valid(member[key]):
                raise ValueError(f"{at}.{key}: {type(member[key]).__name__} {member[key]!r:.80} is not what a "
                                 f"checkpoint holds there")
        traj = member["trajectory"]
        if (traj.tag, traj.seed, traj.env_id, traj.group_id) != (member["tag"], member["seed"], member["env_id"],
                                                                 member["group_id"]):
            raise ValueError(f"{at}.trajectory: it is env {traj.env_id}'s of group {traj.group_id} ({traj.tag}, seed "
                             f"{traj.seed}), not env {member['env_id']}'s of group {member['group_id']} "
                             f"({member['tag']}, seed {member['seed']})")
        if (member["tag"], member["seed"], member["group_id"]) != (group[0]["tag"], group[0]["seed"],
                                                                   group[0]["group_id"]):
            raise ValueError(f"{at}: its tag, seed and group id are not those of {where}[0]: a group's envs share them")
    return group
