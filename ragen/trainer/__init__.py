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

from ragen.trainer.actor import PPOActor
from ragen.trainer.config import TrainerConfig
from ragen.trainer.core import ADV_ESTIMATORS, Sample, compute_advantages, filter_groups, normalize_rewards
from ragen.trainer.logprobs import sequence_logprobs
from ragen.trainer.trainer import AgentTrainer

__all__ = ["ADV_ESTIMATORS", "AgentTrainer", "PPOActor", "Sample", "TrainerConfig", "compute_advantages",
           "filter_groups", "normalize_rewards", "sequence_logprobs"]
