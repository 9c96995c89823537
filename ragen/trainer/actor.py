"""PPOActor: the policy-gradient update of one batch of ``Sample``s.

One ``update(samples, step)``:

1. *Old log-probs*: log pi_old of every answer token, from the current model
   before any weight changes. When the whole update is a single optimizer step
   (one epoch, one mini-batch) they are taken, detached, from that step's own
   forward pass: the weights are the same, so the values are too, and a second
   pass over the batch is saved.
2. *Reference log-probs* (``use_kl_loss`` only): the frozen reference policy,
   which is the model with its LoRA adapter switched off, or a frozen copy of
   the initial model for full fine-tuning.
3. For each of ``ppo_epochs``: the samples (whole groups kept together, their
   order shuffled by a generator seeded from (seed, step, epoch)) are cut into
   mini-batches of ``ppo_mini_batch_size``; each mini-batch into micro-batches
   of ``ppo_micro_batch_size_per_gpu`` whose gradients accumulate (with
   ``share_prefix``, the prompt that every sample of the mini-batch starts with
   runs once, its gradient summed over the micro-batches); then the
   gradient is clipped to ``grad_clip`` and the optimizer steps, under the
   engine's lock when the engine shares these weights.

Every log-prob is taken at the rollout's sampling temperature. The policy
gradient term of each token is weighted by the off-policy correction in force
(``none``, ``tis`` or ``decoupled``; ``ragen.trainer.core.importance_weights``)
against the log-prob the engine sampled the token with, with the old
log-probs as the proximal policy; the weights' statistics are logged under
``off_policy/`` whatever the correction.

The loss per token is ``pg - entropy_coeff * entropy + kl_loss_coef * kl``,
aggregated by ``loss_agg_mode``: ``token-mean`` (every answer token of the
mini-batch weighs the same) or ``seq-mean-token-mean`` (every episode weighs
the same). Both are exact whatever the micro-batch split. The model runs in
eval mode throughout (no dropout), so the policy being scored is the policy
that generated. Each micro-batch pass, scoring ones included, is told to the
update's ``UpdateProgress`` as it ends.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Callable, Sequence

import torch

from ragen.trainer.config import TrainerConfig
from ragen.trainer.core import Sample, WeightStats, group_indices, importance_weights, kl_penalty, policy_loss
from ragen.trainer.logprobs import (AUTO_CHECKPOINT_TOKENS, PromptRoot, can_checkpoint_layers, prompt_root,
                                    sequence_logprobs)
from ragen.trainer.precision import autocast_dtype
from ragen.trainer.progress import UpdateProgress

logger = logging.getLogger(__name__)


class PPOActor:
    """Holds the policy model and its optimizer; ``update(samples, step)`` runs one PPO update."""

    def __init__(
        self,
        model: Any,
        config: TrainerConfig,
        pad_token_id: int = 0,
        reference: Callable[..., list[torch.Tensor]] | None = None,
        weights_lock: Callable[[], contextlib.AbstractContextManager] | None = None,
        temperature: float = 1.0,
        correction: str = "none",
    ) -> None:
        self.model = model
        self.config = config
        self.temperature = float(temperature)  # the rollout's sampling temperature (1 for greedy)
        self.correction = correction  # the off-policy correction in force (ActorSection.correction)
        self._warned_no_logprobs = False
        self.pad_token_id = int(pad_token_id)
        self.reference = reference
        self.weights_lock = weights_lock or contextlib.nullcontext
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            key = "actor_rollout_ref.model.target_modules" if config.use_lora else "actor_rollout_ref.model"
            raise ValueError(f"the model has no trainable parameters (check {key})")
        if config.actor.use_kl_loss and reference is None:
            raise ValueError("actor_rollout_ref.actor.use_kl_loss is true but no reference policy was given")
        self._can_checkpoint = can_checkpoint_layers(model.get_decoder())
        # resolved (and warned about, where the hardware has no native bf16) at start, not at the first update
        _compute_dtype(config, model)
        optim = config.actor.optim
        self.optimizer = torch.optim.AdamW(self.params, lr=optim.lr, betas=optim.betas,
                                           weight_decay=optim.weight_decay)

    @property
    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.params)

    # ------------------------------------------------------------ log-probs

    def _checkpoint_layers(self, samples: Sequence[Sample], micro_batches: Sequence[Sequence[int]]) -> bool:
        """Whether a mini-batch's passes checkpoint their layers (``model.enable_gradient_checkpointing``;
        ``auto``: where a micro-batch (positions in ``samples``) holds ``AUTO_CHECKPOINT_TOKENS`` tokens or
        more and the model can)."""
        setting = self.config.model.enable_gradient_checkpointing
        if setting != "auto":
            return bool(setting)
        longest = max((sum(len(samples[i].input_ids) for i in idx) for idx in micro_batches), default=0)
        return longest >= AUTO_CHECKPOINT_TOKENS and self._can_checkpoint

    def _forward(self, samples: Sequence[Sample], root: PromptRoot | None, entropy_grad: bool,
                 checkpoint_layers: bool):
        return sequence_logprobs(self.model, samples, self.pad_token_id, with_entropy_grad=entropy_grad,
                                 checkpoint_layers=checkpoint_layers, root=root,
                                 **_options(self.config, self.temperature, self.model))

    @torch.no_grad()
    def compute_log_probs(self, samples: Sequence[Sample],
                          on_pass: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """Per sample: log-probs of its answer tokens under the current weights (``on_pass``: called
        after each micro-batch)."""
        self.model.eval()
        return logprobs_by_micro_batch(self.model, samples, self.pad_token_id, self.config, self.temperature,
                                       on_pass)

    # ------------------------------------------------------------ update

    def _order(self, samples: Sequence[Sample], step: int, epoch: int) -> list[int]:
        """Sample positions, whole groups together; the group order shuffled per (seed, step, epoch)."""
        groups = list(group_indices([s.group_key for s in samples]).values())
        if self.config.actor.shuffle and len(groups) > 1:
            gen = torch.Generator().manual_seed(
                (self.config.seed * 1_000_003 + step * 1_009 + epoch) % (2**63 - 1))
            groups = [groups[i] for i in torch.randperm(len(groups), generator=gen).tolist()]
        return [i for g in groups for i in g]

    def update(self, samples: Sequence[Sample], step: int = 0,
               progress: UpdateProgress | None = None) -> dict[str, float]:
        """One PPO update of ``samples`` (training step ``step``); its micro-batch passes are told to
        ``progress`` (by default a bar on a terminal, log lines elsewhere), which it closes."""
        cfg = self.config.actor
        samples = [s for s in samples if s.num_loss_tokens > 0]
        if not samples:
            logger.warning("step %d: no sample has answer tokens; the update is skipped", step)
            return {"actor/n_optimizer_steps": 0.0}
        self.model.eval()
        n = len(samples)
        mini = min(cfg.ppo_mini_batch_size, n)
        micro = min(cfg.ppo_micro_batch_size_per_gpu, mini)
        n_updates = cfg.ppo_epochs * math.ceil(n / mini)
        if (self.correction != "none" and not self._warned_no_logprobs
                and all(s.behaviour_logp is None for s in samples)):
            self._warned_no_logprobs = True
            logger.warning("step %d: the engine returned no log-probs of the tokens it sampled, so the "
                           "off-policy correction (%s) falls back to none", step, self.correction)
        # the passes: scoring the old and the reference policy (logprobs_by_micro_batch's), then training
        scoring = math.ceil(n / cfg.ppo_micro_batch_size_per_gpu)
        training = cfg.ppo_epochs * sum(math.ceil(min(mini, n - start) / micro) for start in range(0, n, mini))
        total = scoring * ((n_updates > 1) + cfg.use_kl_loss) + training
        with progress if progress is not None else UpdateProgress(step, total) as shown:
            old = None
            if n_updates > 1:
                shown.start("old log-probs")
                old = self.compute_log_probs(samples, on_pass=shown.passed)
            ref = None
            if cfg.use_kl_loss:
                shown.start("reference log-probs")
                with torch.no_grad():
                    ref = self.reference(samples, on_pass=shown.passed)  # type: ignore[misc]
            return self._epochs(samples, step, mini, micro, old, ref, shown)

    def _epochs(self, samples: list[Sample], step: int, mini: int, micro: int, old: list[torch.Tensor] | None,
                ref: list[torch.Tensor] | None, progress: UpdateProgress) -> dict[str, float]:
        """The update's epochs over mini-batches of ``mini`` samples, micro-batches of ``micro``; its metrics."""
        cfg = self.config.actor
        n = len(samples)
        sums: dict[str, float] = {"pg": 0.0, "entropy": 0.0, "kl": 0.0, "ppo_kl": 0.0, "clip": 0.0, "tokens": 0.0}
        weights = WeightStats()
        grad_norms: list[float] = []
        skipped = checkpointed = 0
        for epoch in range(cfg.ppo_epochs):
            progress.start(f"epoch {epoch + 1}/{cfg.ppo_epochs}")
            order = self._order(samples, step, epoch)
            for mb_start in range(0, n, mini):
                mb = order[mb_start: mb_start + mini]
                if cfg.loss_agg_mode == "token-mean":
                    denom = float(sum(samples[i].num_loss_tokens for i in mb))
                else:
                    denom = float(len(mb))
                micro_batches = [mb[mc_start: mc_start + micro] for mc_start in range(0, len(mb), micro)]
                checkpoint_layers = self._checkpoint_layers(samples, micro_batches)
                checkpointed += checkpoint_layers
                # the prompt every sample of the mini-batch starts with: run once, its gradient summed
                root = _prompt_root(self.model, [samples[i] for i in mb], self.config, checkpoint_layers)
                for idx in micro_batches:
                    self._micro_step([samples[i] for i in idx], root, None if old is None else [old[i] for i in idx],
                                     None if ref is None else [ref[i] for i in idx], denom, sums,
                                     weights if epoch == 0 else None, checkpoint_layers)
                    progress.passed()
                if root is not None:
                    root.backward()
                norm = self._optimizer_step(step)
                if norm is None:
                    skipped += 1
                else:
                    grad_norms.append(norm)
        tokens = max(sums["tokens"], 1.0)
        metrics = {
            "actor/pg_loss": sums["pg"] / tokens,
            "actor/entropy": sums["entropy"] / tokens,
            "actor/ppo_kl": sums["ppo_kl"] / tokens,
            "actor/clip_frac": sums["clip"] / tokens,
            "actor/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "actor/lr": self.optimizer.param_groups[0]["lr"],
            "actor/n_optimizer_steps": float(len(grad_norms)),
            "actor/skipped_steps": float(skipped),
            "actor/checkpointed_steps": float(checkpointed),  # optimizer steps whose layers were checkpointed
            "actor/n_samples": float(n),
            "actor/n_tokens": float(sum(s.num_loss_tokens for s in samples)),
        }
        if cfg.use_kl_loss:
            metrics["actor/kl"] = sums["kl"] / tokens
        metrics.update(self._weight_metrics(weights, metrics["actor/n_tokens"]))
        return metrics

    def _optimizer_step(self, step: int) -> float | None:
        """Clip the gradient and step; the gradient norm, or None where it is not finite and the step
        is skipped (one bad batch must not poison the weights)."""
        max_norm = self.config.actor.grad_clip if self.config.actor.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        stepped = math.isfinite(norm)
        if stepped:
            with self.weights_lock():
                self.optimizer.step()
        else:
            logger.warning("step %d: gradient norm is %s; this optimizer step is skipped", step, norm)
        self.optimizer.zero_grad(set_to_none=True)
        return norm if stepped else None

    def _weight_metrics(self, w: WeightStats, n_tokens: float) -> dict[str, float]:
        """The off-policy correction's statistics over the batch's tokens with a behaviour log-prob."""
        out = {"off_policy/logprob_token_frac": w.tokens / n_tokens if n_tokens else 0.0}
        if w.tokens:
            out.update({
                "off_policy/mismatch_kl": w.mismatch_kl / w.tokens,
                "off_policy/is_weight_mean": w.weight_sum / w.tokens,
                "off_policy/is_weight_max": w.weight_max,
                # tis truncates these to the cap; decoupled drops them
                "off_policy/over_cap_frac": w.over_cap / w.tokens,
            })
        return out

    def _micro_step(self, samples: Sequence[Sample], root: PromptRoot | None, old: list[torch.Tensor] | None,
                    ref: list[torch.Tensor] | None, denom: float, sums: dict[str, float],
                    weights: WeightStats | None, checkpoint_layers: bool) -> None:
        cfg = self.config.actor
        stats = self._forward(samples, root, cfg.entropy_coeff != 0.0, checkpoint_layers)
        logp = stats.logp
        device = logp.device
        # the proximal policy: the weights at the start of the update
        old_logp = logp.detach() if old is None else torch.cat(old).to(device)
        adv = torch.cat([torch.full((c,), float(s.advantage), device=device) for s, c in zip(samples, stats.counts)])
        behaviour = torch.cat([torch.full((c,), math.nan, device=device) if s.behaviour_logp is None
                               else torch.tensor(s.behaviour_logp, dtype=torch.float32, device=device)
                               for s, c in zip(samples, stats.counts)])
        weight, weight_stats = importance_weights(old_logp, behaviour, self.correction, cfg.tis_cap)
        if weights is not None:  # once per token: the weights do not change between epochs
            weights.add(weight_stats)
        pg, clipped = policy_loss(logp, old_logp, adv, *self.config.actor.clip_range)
        pg = pg * weight
        per_token = pg
        if cfg.entropy_coeff != 0.0:
            per_token = per_token - cfg.entropy_coeff * stats.entropy
        kl = None
        if ref is not None:
            kl = kl_penalty(logp, torch.cat(ref).to(device), cfg.kl_loss_type)
            per_token = per_token + cfg.kl_loss_coef * kl
        if cfg.loss_agg_mode == "token-mean":
            loss = per_token.sum() / denom
        else:
            loss = sum(part.mean() for part in torch.split(per_token, stats.counts)) / denom
        loss.backward()
        with torch.no_grad():
            sums["pg"] += float(pg.sum())
            sums["entropy"] += float(stats.entropy.sum())
            sums["ppo_kl"] += float((old_logp - logp).sum())
            sums["clip"] += float(clipped.sum())
            sums["tokens"] += float(logp.numel())
            if kl is not None:
                sums["kl"] += float(kl.sum())


# ---------------------------------------------------------------- reference policies


def logprobs_by_micro_batch(model: Any, samples: Sequence[Sample], pad_token_id: int, config: TrainerConfig,
                            temperature: float, on_pass: Callable[[], None] | None = None) -> list[torch.Tensor]:
    """Per sample, its answer tokens' log-probs under ``model``, ``ppo_micro_batch_size_per_gpu``
    samples a pass (no gradient: the caller turns it off); ``on_pass`` is called after each pass."""
    out: list[torch.Tensor] = []
    micro = config.actor.ppo_micro_batch_size_per_gpu
    root = _prompt_root(model, samples, config)
    for start in range(0, len(samples), micro):
        stats = sequence_logprobs(model, samples[start: start + micro], pad_token_id, root=root,
                                  **_options(config, temperature, model))
        out += list(torch.split(stats.logp.detach(), stats.counts))
        if on_pass is not None:
            on_pass()
    return out


def _prompt_root(model: Any, samples: Sequence[Sample], config: TrainerConfig,
                 checkpoint_layers: bool = False) -> PromptRoot | None:
    """The samples' prompt root where prefixes are shared (``model.share_prefix``), else None."""
    if not config.model.share_prefix:
        return None
    return prompt_root(model, samples, checkpoint_layers, _compute_dtype(config, model))


def _options(config: TrainerConfig, temperature: float, model: Any) -> dict[str, Any]:
    """``sequence_logprobs``'s settings from the config, the same for the actor and its references."""
    return {"share_prefix": config.model.share_prefix, "temperature": temperature,
            "chunk_size": config.actor.logprob_chunk_size, "autocast": _compute_dtype(config, model)}


def _compute_dtype(config: TrainerConfig, model: Any) -> torch.dtype | None:
    """The decoder's autocast dtype on ``model``'s device (``actor.autocast``; None: float32)."""
    return autocast_dtype(config.actor.autocast, next(model.parameters()).device.type)


def adapter_off_reference(peft_model: Any, pad_token_id: int, config: TrainerConfig, temperature: float = 1.0):
    """The reference of a LoRA run: the same model with its adapter switched off (no copy)."""

    @torch.no_grad()
    def ref(samples: Sequence[Sample], on_pass: Callable[[], None] | None = None) -> list[torch.Tensor]:
        with peft_model.disable_adapter():
            return logprobs_by_micro_batch(peft_model, samples, pad_token_id, config, temperature, on_pass)

    return ref


def frozen_copy_reference(model: Any, pad_token_id: int, config: TrainerConfig, temperature: float = 1.0):
    """The reference of a full fine-tuning run: a frozen copy of the initial weights."""
    import copy

    frozen = copy.deepcopy(model).eval()
    for p in frozen.parameters():
        p.requires_grad_(False)

    @torch.no_grad()
    def ref(samples: Sequence[Sample], on_pass: Callable[[], None] | None = None) -> list[torch.Tensor]:
        return logprobs_by_micro_batch(frozen, samples, pad_token_id, config, temperature, on_pass)

    ref.model = frozen  # type: ignore[attr-defined]
    return ref
