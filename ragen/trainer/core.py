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

- *Token log-probs* (``sequence_logprobs``): log pi(token | prefix) of the
  model's own tokens, with the entropy of the next-token distribution there.
  The output layer runs only at the positions that predict a loss token, a
  chunk of them at a time (``token_stats``), and each chunk's
  full-vocabulary logits are made again in the backward pass instead of
  being kept for it.
  Sequences of one group start with the same prompt; that *shared prefix* is
  run once (its key/value cache repeated for the members, which keeps gradients
  exact) instead of once per member. On a CPU most tokens of an agent episode
  are prompt, so this is the largest saving of the update.
  Logits are divided by the rollout's sampling temperature first (1 for greedy
  decoding), so the policy scored is the distribution the engine sampled from.
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

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from ragen.rollout.context import GROUPINGS, METHODS, ContextConfig
from ragen.utils import common_prefix_length

ADV_ESTIMATORS = ("grpo", "reinforce")
CORRECTIONS = ("none", "tis", "decoupled")
# Below this many shared tokens a separate prefix pass costs more than it saves.
MIN_SHARED_PREFIX = 8
# Loss positions whose logits are made at once: a chunk's full-vocabulary logits in float32
# (positions x vocabulary x 4 bytes: 50 MB at 256 x 49,152) are the largest tensor of the update.
DEFAULT_CHUNK_SIZE = 256


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


# ---------------------------------------------------------------- log-probs


@dataclass
class TokenStats:
    """Per micro-batch: values at the loss tokens, flattened in sample order."""

    logp: torch.Tensor  # (n_tokens,)
    entropy: torch.Tensor  # (n_tokens,)
    counts: list[int]  # loss tokens per sample


def _chunk_stats(hidden: torch.Tensor, targets: torch.Tensor, head: Any, temperature: float,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and the entropy at the rows of ``hidden`` (positions, model width), from the
    output layer's logits divided by ``temperature``, in float32; the entropy has a gradient only
    ``with_entropy``."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None])[:, 0] - logz
    with contextlib.nullcontext() if with_entropy else torch.no_grad():
        entropy = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def token_stats(hidden: torch.Tensor, targets: torch.Tensor, head: Any, temperature: float = 1.0,
                with_entropy_grad: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and the entropy at each row of ``hidden`` (the last layer's states at the
    positions that predict ``targets``), ``chunk_size`` rows at a time. With gradients on, each
    chunk's logits are made again in the backward pass rather than kept (activation
    checkpointing), so no full-vocabulary tensor outlives its chunk."""
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        args = (hidden[start: start + chunk_size], targets[start: start + chunk_size], head, temperature,
                with_entropy_grad)
        if torch.is_grad_enabled():
            logp, entropy = checkpoint(_chunk_stats, *args, use_reentrant=False)
        else:
            logp, entropy = _chunk_stats(*args)
        logps.append(logp)
        entropies.append(entropy if with_entropy_grad else entropy.detach())
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)


def loss_positions(sample: Sample) -> list[int]:
    """Positions t (t >= 1) whose token is the model's; its log-prob comes from logits at t - 1."""
    return [t for t, m in enumerate(sample.loss_mask) if m and t >= 1]


def _model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def sequence_logprobs(
    model: Any,
    samples: Sequence[Sample],
    pad_token_id: int = 0,
    with_entropy_grad: bool = False,
    share_prefix: bool = True,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> TokenStats:
    """Log-probs (and entropies) of each sample's loss tokens under ``model`` with its logits
    divided by ``temperature`` (the sampling temperature; 1 for greedy decoding).

    The model's decoder runs over the tokens; its output layer only at the positions that
    predict a loss token, ``chunk_size`` of them at a time (``token_stats``). Samples with
    the same ``group_key`` whose token lists share at least ``MIN_SHARED_PREFIX`` leading
    tokens are run as one prefix pass plus a batch of suffixes; the rest as one left-padded
    batch. Gradients flow when the caller has them enabled; results are in sample order
    either way.
    """
    device = _model_device(model)
    run = _Passes(model.get_decoder(), model.get_output_embeddings(), device, pad_token_id, with_entropy_grad,
                  temperature, chunk_size)
    per_sample: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(samples)
    rest: list[int] = []
    clusters = group_indices([s.group_key for s in samples]) if share_prefix else {}
    if not share_prefix:
        rest = list(range(len(samples)))
    for members in clusters.values():
        if len(members) < 2:
            rest += members
            continue
        seqs = [samples[i].input_ids for i in members]
        first_loss = min(loss_positions(samples[i])[0] for i in members if loss_positions(samples[i]))
        # The token before the first answer token stays in the suffix: its logits score that answer token.
        shared = min(common_prefix_length(seqs), first_loss - 1)
        if shared < MIN_SHARED_PREFIX:
            rest += members
            continue
        for i, out in zip(members, run.shared_prefix([samples[i] for i in members], shared)):
            per_sample[i] = out
    if rest:
        rest.sort()
        for i, out in zip(rest, run.padded([samples[i] for i in rest])):
            per_sample[i] = out
    logps = [p[0] for p in per_sample]  # type: ignore[index]
    ents = [p[1] for p in per_sample]  # type: ignore[index]
    return TokenStats(logp=torch.cat(logps), entropy=torch.cat(ents), counts=[len(x) for x in logps])


@dataclass(frozen=True)
class _Passes:
    """The forward passes of ``sequence_logprobs``: the model's decoder (its last layer's states,
    normalized) and its output layer (``head``), applied at the loss positions alone."""

    decoder: Any
    head: Any
    device: torch.device
    pad_token_id: int
    with_entropy_grad: bool
    temperature: float
    chunk_size: int

    def shared_prefix(self, samples: Sequence[Sample], shared: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = len(samples)
        prefix = torch.tensor([samples[0].input_ids[:shared]], dtype=torch.long, device=self.device)
        cache = self.decoder(input_ids=prefix, use_cache=True).past_key_values
        # Every member attends to the same prefix keys/values; repeat_interleave is differentiable,
        # so the prefix's gradient is the sum over members, as in n separate passes.
        cache.batch_repeat_interleave(n)
        suffixes = [s.input_ids[shared:] for s in samples]
        width = max(len(s) for s in suffixes)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long, device=self.device)
        for row, suffix in enumerate(suffixes):  # right padding: pads come after every real token
            ids[row, : len(suffix)] = torch.tensor(suffix, dtype=torch.long)
        mask = torch.ones((n, shared + width), dtype=torch.long, device=self.device)
        positions = (shared + torch.arange(width, device=self.device)).unsqueeze(0).expand(n, -1)
        hidden = self.decoder(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                              use_cache=True).last_hidden_state
        return self.at_loss_positions(hidden, samples, [-shared] * n)

    def padded(self, samples: Sequence[Sample]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = len(samples)
        width = max(len(s.input_ids) for s in samples)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((n, width), dtype=torch.long, device=self.device)
        offsets = []
        for row, s in enumerate(samples):  # left padding, as in generation
            off = width - len(s.input_ids)
            ids[row, off:] = torch.tensor(s.input_ids, dtype=torch.long)
            mask[row, off:] = 1
            offsets.append(off)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.decoder(input_ids=ids, attention_mask=mask, position_ids=positions,
                              use_cache=False).last_hidden_state
        return self.at_loss_positions(hidden, samples, offsets)

    def at_loss_positions(self, hidden: torch.Tensor, samples: Sequence[Sample],
                          shifts: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample, its loss tokens' log-probs and entropies. The state that predicts the
        token at position ``p`` of ``samples[row]`` is ``hidden[row, p - 1 + shifts[row]]``
        (``shifts``: where the row's states start against the sample's positions)."""
        rows, targets, counts = [], [], []
        for row, sample in enumerate(samples):
            pos = loss_positions(sample)
            rows.append(hidden[row, torch.tensor(pos, dtype=torch.long, device=self.device) - 1 + shifts[row]])
            targets.append(torch.tensor([sample.input_ids[p] for p in pos], dtype=torch.long, device=self.device))
            counts.append(len(pos))
        logp, entropy = token_stats(torch.cat(rows), torch.cat(targets), self.head, self.temperature,
                                    self.with_entropy_grad, self.chunk_size)
        return list(zip(torch.split(logp, counts), torch.split(entropy, counts)))


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


KL_TYPES = ("low_var_kl", "kl", "mse")
