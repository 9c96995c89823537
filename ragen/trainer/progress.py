"""UpdateProgress: how far one policy update has got, shown while it runs.

An update is passes over micro-batches (``ppo_micro_batch_size_per_gpu``
samples each): the old policy's log-probs (when the update takes more than one
optimizer step), the reference policy's (``use_kl_loss``), then each epoch's
forward and backward passes. ``PPOActor.update`` counts them all up front and
tells this display each pass as it ends, with the phase it is in; it is shown
as the rollout's progress is (``ragen.progress``): a bar on a terminal, whole
``[Progress] update ...`` log lines elsewhere, nothing for an update shorter
than ``delay_s``.
"""

from __future__ import annotations

import logging
from typing import Any

from ragen.progress import ProgressDisplay

logger = logging.getLogger(__name__)


class UpdateProgress(ProgressDisplay):
    """The micro-batch passes of the update of training step ``step``, out of
    ``total`` (``ProgressDisplay``'s keyword arguments)."""

    log = logger

    def __init__(self, step: int, total: int, **display: Any) -> None:
        self.step = step
        self.done = 0
        self.phase = ""
        super().__init__(total, f"update {step}", "micro-batch", **display)

    def start(self, phase: str) -> None:
        """The passes that follow belong to ``phase`` (``old log-probs``, ``reference``, ``epoch 1/2``)."""
        with self._lock:
            self.phase = phase
            self._show(0)

    def passed(self) -> None:
        """One more micro-batch pass ended."""
        with self._lock:
            self.done = min(self.total, self.done + 1)
            self._show(1)

    def __enter__(self) -> "UpdateProgress":
        return self

    def describe(self) -> str:
        return f"[Progress] update of step {self.step}: {self.done}/{self.total} micro-batches | {self.phase}"

    def postfix(self) -> str:
        return self.phase
