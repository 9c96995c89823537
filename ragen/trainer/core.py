"""The algorithm: from scored episodes to a policy-gradient loss.

- *Group filtering* (``filter_groups``): RAGEN's ``rollout_filter_ratio``. A
  group is the env instances that shared one initial state (one ``group_id``);
  groups whose members all scored alike teach a group-normalized estimator
  nothing, so only the top fraction of groups by in-group reward std is kept.
- *Advantage estimators* (``compute_advantages``, ``ADV_ESTIMATORS``), one
  scalar per episode, given to every token the model wrote in it:

  - ``grpo``: RAGEN's reward normalization (``normalize_rewards``, as configured), then
    (score - group mean) / (group std + eps) per group; with
    ``norm_adv_by_std_in_grpo: false`` only the mean is removed (Dr. GRPO).
  - ``reinforce``: RAGEN's reward normalization alone
    (``agent_proxy.reward_normalization.grouping`` / ``.method``); with the
    default ``identity`` that is the raw episode reward.

- *Token log-probs*: ``ragen.trainer.logprobs``.
- *Off-policy correction* (``importance_weights``, ``CORRECTIONS``): the
  engine's log-prob of each sampled token (the *behaviour* policy, which may be
  versions older than the trainer, or numerically different) against the
  proximal policy recomputed at the start of the update. ``tis`` multiplies the
  policy-gradient term by the truncated weight ``min(pi_prox / pi_behav, C)``;
  ``decoupled`` is AReaL's decoupled PPO objective, whose cap drops the tokens
  with a weight above ``C`` rather than truncating it; ``none`` uses no weight.
  Tokens without a behaviour log-prob weigh 1.
- *Losses*: PPO's clipped surrogate (``policy_loss``, asymmetric clip range
  allowed), the low-variance KL estimator to a reference (``kl_penalty``), and
  an entropy bonus; all are per-token and summed by the caller, who divides by
  the mini-batch's token count (token-mean aggregation, independent of how the
  mini-batch is cut into micro-batches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ragen.rollout.context import GROUPINGS, METHODS, ContextConfig
from ragen.trainer.config import ADV_ESTIMATORS, CORRECTIONS, KL_TYPES


@dataclass
class Sample:
    """One episode as a training sequence (token lists; tensors are built per micro-batch)."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 on the model's own tokens (answers and their end-of-turn token)
    advantage: float
    group_key: Any  # sequences with equal keys usually share their prompt
    score: float = 0.0
    truncated: bool = False  # cut at the maximum sequence length
    # per loss token: its log-prob under the policy that sampled it (NaN: not known); None: none known
    behaviour_logp: list[float] | None = None
    policy_version: int = 0  # of the oldest turn: the policy that sampled the episode's first answer

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(self.loss_mask))


def loss_positions(sample: Sample) -> list[int]:
    """Positions t (t >= 1) whose token is the model's; its log-prob comes from logits at t - 1."""
    return [t for t, m in enumerate(sample.loss_mask) if m and t >= 1]


# ---------------------------------------------------------------- groups & advantages


def group_indices(group_ids: Sequence[Any]) -> dict[Any, list[int]]:
    """group id -> positions, in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups


def filter_groups(scores: Sequence[float], group_ids: Sequence[Any], ratio: float) -> list[int]:
    """Positions of the episodes in the top ``ratio`` of groups by reward std.

    At least one group is kept; ties keep the earlier group (a stable sort), so
    the choice is deterministic. ``ratio >= 1`` keeps everything.
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"actor_rollout_ref.rollout.rollout_filter_ratio must be in (0, 1], got {ratio}")
    groups = group_indices(group_ids)
    if ratio >= 1.0:
        return list(range(len(scores)))
    x = np.asarray(scores, dtype=np.float64)
    keys = list(groups)
    stds = [float(x[groups[k]].std()) for k in keys]
    n_keep = max(1, int(math.ceil(ratio * len(keys))))
    order = sorted(range(len(keys)), key=lambda i: -stds[i])  # sorted() is stable
    kept = {keys[i] for i in order[:n_keep]}
    return [i for i, g in enumerate(group_ids) if g in kept]


def compute_advantages(
    scores: Sequence[float],
    group_ids: Sequence[Any],
    tags: Sequence[str],
    context: ContextConfig,
    estimator: str = "grpo",
    norm_adv_by_std: bool = True,
) -> np.ndarray:
    """One advantage per episode; see the module docstring for the estimators."""
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator: unknown {estimator!r}; choose one of {ADV_ESTIMATORS}")
    shaped = normalize_rewards(scores, group_ids, tags, context.reward_grouping, context.reward_method)
    if estimator == "reinforce":
        return shaped
    # GRPO's own normalization is always per state group, whatever the shaping grouping was.
    return normalize_rewards(shaped, group_ids, tags, "state", "mean_std" if norm_adv_by_std else "mean")


def normalize_rewards(scores: Sequence[float], group_ids: Sequence[Any], tags: Sequence[str],
                      grouping: str = "state", method: str = "identity") -> np.ndarray:
    """RAGEN's reward normalization of episode scores: ``method`` (``METHODS``)
    applied within each group of ``grouping`` (``GROUPINGS``: ``state``, the
    episodes of one initial state; ``inductive``, of one env tag; ``batch``, all)."""
    if grouping not in GROUPINGS or method not in METHODS:
        raise ValueError(f"reward normalization: grouping {grouping!r} / method {method!r}; "
                         f"choose a grouping of {GROUPINGS} and a method of {METHODS}")
    x = np.asarray(scores, dtype=np.float64)
    if grouping == "state":
        keys = list(group_ids)
    elif grouping == "inductive":
        keys = list(tags)
    else:
        keys = [0] * len(x)
    out = np.empty_like(x)
    for key in dict.fromkeys(keys):
        idx = np.array([i for i, k in enumerate(keys) if k == key])
        out[idx] = _normalize(x[idx], method)
    return out


def _normalize(x: np.ndarray, method: str) -> np.ndarray:
    if method == "identity":
        return x.copy()
    if method == "mean":
        return x - x.mean()
    std = x.std()
    z = (x - x.mean()) / (std + 1e-6) if len(x) > 1 else x - x.mean()
    if method == "mean_std":
        return z
    return np.clip(z, -1.0, 3.0)  # asym_clip: keep rare large successes, bound failures


# ---------------------------------------------------------------- losses


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, and whether the clip was active there."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float()


@dataclass
class WeightStats:
    """Sums over the tokens that have a behaviour log-prob (the statistics of the correction)."""

    tokens: int = 0  # loss tokens with a behaviour log-prob
    weight_sum: float = 0.0  # of pi_prox / pi_behav, before any cap
    weight_max: float = 0.0
    over_cap: int = 0  # tokens whose weight passed the cap (truncated by tis, dropped by decoupled)
    mismatch_kl: float = 0.0  # k3 estimate of KL(pi_behav || pi_prox), summed

    def add(self, other: "WeightStats") -> None:
        self.tokens += other.tokens
        self.weight_sum += other.weight_sum
        self.weight_max = max(self.weight_max, other.weight_max)
        self.over_cap += other.over_cap
        self.mismatch_kl += other.mismatch_kl


def importance_weights(proximal: torch.Tensor, behaviour: torch.Tensor, mode: str,
                       cap: float) -> tuple[torch.Tensor, WeightStats]:
    """Per token, the weight of the policy-gradient term, and its statistics.

    ``proximal``: log pi_prox, recomputed at the start of the update; ``behaviour``: log pi_behav,
    the engine's (NaN where unknown: weight 1, left out of the statistics). The weight is
    ``w = pi_prox / pi_behav``: truncated at ``cap`` (``tis``), or 0 past ``cap`` (``decoupled``),
    or 1 (``none``). The statistics are the same in every mode.
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"actor_rollout_ref.actor.off_policy_correction: unknown {mode!r}; choose one of "
                         f"{list(CORRECTIONS)}")
    proximal = proximal.detach()
    known = ~torch.isnan(behaviour)
    # clamped as the KL penalty is: a token the engine found 1e9 times likelier must not overflow
    log_w = torch.where(known, (proximal - behaviour).clamp(-20.0, 20.0), torch.zeros_like(proximal))
    w = torch.exp(log_w)
    if mode == "tis":
        weight = torch.clamp(w, max=cap)
    elif mode == "decoupled":
        weight = torch.where(w <= cap, w, torch.zeros_like(w))
    else:
        weight = torch.ones_like(w)
    n = int(known.sum())
    stats = WeightStats(
        tokens=n,
        weight_sum=float(w[known].sum()) if n else 0.0,
        weight_max=float(w[known].max()) if n else 0.0,
        over_cap=int((known & (w > cap)).sum()),
        # w - 1 - log w, as expm1 so that float32 rounding cannot make a near-zero KL negative
        mismatch_kl=float((torch.expm1(log_w.double()) - log_w.double())[known].sum()) if n else 0.0,
    )
    return weight, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate: ``kl`` (k1), ``mse`` (k2) or ``low_var_kl`` (k3, clamped)."""
    diff = logp - ref_logp
    if kind == "kl":
        return diff
    if kind == "mse":
        return 0.5 * diff.square()
    if kind == "low_var_kl":
        log_ratio = torch.clamp(-diff, -20.0, 20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
    raise ValueError(f"actor_rollout_ref.actor.kl_loss_type: unknown {kind!r}; choose one of {KL_TYPES}")

