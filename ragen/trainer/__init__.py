"""The trainer: GRPO/PPO on the agent's rollouts, with the rollout engine's own model.

- ``config``: ``TrainerConfig``, the ``trainer.*`` / ``actor_rollout_ref.*`` /
  ``algorithm.*`` sections, read and checked once at start-up and held whole
  (``config.run``, ``config.actor``, ``config.model``, ...).
- ``core``: ``Sample`` (one episode as tokens + loss mask + advantage), group
  filtering, RAGEN's reward normalization, advantage estimators, the clipped policy loss and the
  KL estimators.
- ``logprobs``: token log-probs and entropies at the loss positions, in chunks, with shared
  prompt prefixes; ``memory``: a training step's peak memory.
- ``samples``: a rollout made into ``Sample``s with advantages, and the batch's metrics.
- ``actor``: ``PPOActor``, the update over mini- and micro-batches.
- ``policy``: the trained model (the engine's own, or a copy), its LoRA adapter, and its
  weights as an engine and a checkpoint take them.
- ``trainer``: ``AgentTrainer``, the loop: rollout -> samples -> update ->
  weight sync, validation, checkpoints, resume.
- ``checkpoint``: atomic checkpoints and finding the latest.
- ``tracking``: metrics.jsonl, console summary, optional TensorBoard / W&B,
  the learning-curve PNG.

``train.py`` at the repository root is the Hydra command line over these.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it; imported on first use, so that ``ragen.trainer.config`` (train.py's
# start-up checks) is read without torch
_EXPORTS = {
    "ADV_ESTIMATORS": "ragen.trainer.config",
    "AgentTrainer": "ragen.trainer.trainer",
    "PPOActor": "ragen.trainer.actor",
    "Sample": "ragen.trainer.core",
    "TrainerConfig": "ragen.trainer.config",
    "compute_advantages": "ragen.trainer.core",
    "filter_groups": "ragen.trainer.core",
    "normalize_rewards": "ragen.trainer.core",
    "sequence_logprobs": "ragen.trainer.logprobs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(attr: str) -> Any:
    if attr in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[attr]), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
