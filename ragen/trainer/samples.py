"""From a rollout to a training batch: the ``Sample``s of the kept groups with their advantages, the
batch's metrics, and the rollout's metrics under the split's names."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ragen.rollout.context import ContextConfig, ContextManager
from ragen.rollout.types import RolloutResult
from ragen.trainer.config import TrainerConfig
from ragen.trainer.core import Sample, compute_advantages, filter_groups, loss_positions


def rename_rollout_metrics(metrics: Mapping[str, float], split: str) -> dict[str, float]:
    """``rollout/...`` -> ``train/...`` or ``val/...``; the other names (timing, engine) are kept,
    prefixed with ``val/`` for validation so they never overwrite the training step's."""
    out = {}
    for key, value in metrics.items():
        if key.startswith("rollout/"):
            out[f"{split}/{key[len('rollout/'):]}"] = value
        elif split == "train":
            out[key] = value
        else:
            out[f"val/{key}"] = value
    return out


def make_samples(result: RolloutResult, ctx: ContextManager, chat: Any, cfg: TrainerConfig,
                 context: ContextConfig) -> tuple[list[Sample], dict[str, float]]:
    """Training samples of the kept groups, with their advantages, and batch metrics. The groups
    the rollout dropped (a failed env, or no signal: ``RolloutResult.dropped_groups``) are left out.

    An episode is one sample, or several (an agent episode's segments or calls:
    ``ContextManager.formulate_rollouts``). Groups are filtered and advantages computed over
    episodes, as a group compares episodes; every sample of an episode gets its advantage and score,
    and the oldest policy version of its own turns."""
    dropped = result.dropped_groups
    trajs = [(t, s) for t, s in zip(result.trajectories, result.specs) if t.turns and t.group_id not in dropped]
    if not trajs:
        return [], {"batch/n_samples": 0.0, "batch/n_episodes": 0.0, "batch/dropped_groups": float(len(dropped))}
    max_len = cfg.rollout.max_model_len
    rows = ctx.formulate_rollouts([(spec, t.turns) for t, spec in trajs], chat, max_len)
    metrics = _response_metrics([t for t, _ in trajs], rows)
    scores = [t.reward for t, _ in trajs]
    group_ids = [t.group_id for t, _ in trajs]
    kept = filter_groups(scores, group_ids, cfg.rollout.rollout_filter_ratio)
    adv = compute_advantages([scores[i] for i in kept], [group_ids[i] for i in kept],
                             [trajs[i][0].tag for i in kept], context,
                             cfg.algorithm.adv_estimator, cfg.algorithm.norm_adv_by_std_in_grpo)
    samples = []
    for a, i in zip(adv, kept):
        turns = trajs[i][0].turns
        for row in rows[i]:
            sample = Sample(
                input_ids=row["input_ids"], loss_mask=row["loss_mask"], advantage=float(a),
                group_key=group_ids[i], score=scores[i],
                truncated=max_len is not None and len(row["input_ids"]) >= max_len,
                policy_version=min(turns[k].policy_version for k in row["turns"]),
            )
            behaviour = row["behaviour_logprobs"]
            if behaviour is not None and any(not math.isnan(x) for x in behaviour):
                sample.behaviour_logp = [behaviour[t] for t in loss_positions(sample)]
            samples.append(sample)
    agents = [i for i in kept if trajs[i][1].is_agent]
    metrics.update({
        "batch/n_groups": float(len(set(group_ids))),
        "batch/dropped_groups": float(len(dropped)),  # by the rollout: a failed env, or no signal
        "batch/kept_groups": float(len({group_ids[i] for i in kept})),
        "batch/n_episodes": float(len(kept)),  # trained: each has one advantage
        "batch/n_samples": float(len(samples)),  # sequences trained: an agent episode has one per segment or call
        # segments of the trained agent episodes: calls that rewrote their history start one
        "batch/agent_segments": float(sum(len({t.info.get("segment") for t in trajs[i][0].turns}) for i in agents)),
        "batch/truncated": float(sum(s.truncated for s in samples)),  # samples cut at max_model_len
        "batch/seq_len_mean": float(np.mean([len(s.input_ids) for s in samples])) if samples else 0.0,
        # over the trained episodes
        "batch/advantage_abs_mean": float(np.mean(np.abs(adv))) if len(adv) else 0.0,
        "batch/zero_adv_frac": float(np.mean(np.abs(adv) < 1e-8)) if len(adv) else 0.0,
    })
    return samples, metrics


def _response_metrics(trajectories: list[Any], rows: list[list[dict[str, Any]]]) -> dict[str, float]:
    """The answers' lengths in tokens (their mean per turn, their most in one episode) and the
    share of turns cut at their token limit."""
    n_turns = sum(len(t.turns) for t in trajectories)
    answer_tokens = [sum(sum(r["loss_mask"]) for r in episode) for episode in rows]
    return {
        "response_length/mean": sum(answer_tokens) / max(n_turns, 1),
        "response_length/max": float(max(answer_tokens)),
        "response_length/clip_ratio": sum(tn.finish_reason == "length" for t in trajectories
                                          for tn in t.turns) / max(n_turns, 1),
    }
