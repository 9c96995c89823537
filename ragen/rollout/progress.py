"""RolloutProgress: how far one rollout has got, shown while it runs.

The driver makes one per rollout with the number of envs asked for. It is
told three things as they happen: envs finished (``envs_finished``), requests
answered by the engine, i.e. turns (``answered``), and the size of the latest
engine call (``engine_batch``). The sequential loop tells it directly; in the
parallel rollout the driver's ``SharedLLMInferenceManager`` does, from the
requests it answers and the finished-env counts that workers add to the
messages they send anyway (``wire``). A synchronous backend also has it read
the tokens its engine has sampled (``watch_tokens``), so one long engine call
(a whole Bandit rollout is one) shows its answers growing, not only its time.

It is shown as ``ragen.progress.ProgressDisplay`` shows work: on a terminal a
bar on stderr, removed when the rollout ends (where the per-step summary line
takes over); elsewhere ``[Progress] ...`` log lines. Progress only reads
counts: it never changes a trajectory, and its calls are cheap (a lock and a
few additions).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ragen.progress import ProgressDisplay

logger = logging.getLogger(__name__)


class RolloutProgress(ProgressDisplay):
    """Counts of one rollout, shown as a bar or as log lines (``ProgressDisplay``'s
    keyword arguments: ``delay_s``, ``log_every_s``, ``file``, ``terminal``,
    ``disable``, ``clock``, ``tick_s``)."""

    log = logger

    def __init__(self, total: int, split: str = "rollout", **display: Any) -> None:
        self.split = split
        self.finished = 0
        self.turns = 0
        self.batch_size = 0
        self._tokens: Callable[[], int] | None = None
        super().__init__(total, f"rollout {split}", "env", **display)

    # ----- events (any thread) -------------------------------------------------------
    def envs_finished(self, n: int) -> None:
        """``n`` more envs ended (the count never passes ``total``: envs a
        worker re-runs after a failure are reported again)."""
        with self._lock:
            before = self.finished
            self.finished = min(self.total, self.finished + n)
            self._show(self.finished - before)

    def answered(self, n: int) -> None:
        """``n`` more requests (env turns) were answered by the engine."""
        with self._lock:
            self.turns += n
            self._show(0)

    def engine_batch(self, size: int) -> None:
        """The engine was just called with ``size`` requests."""
        with self._lock:
            self.batch_size = size
            self._show(0)

    def watch_tokens(self, read: Callable[[], int]) -> None:
        """``read()`` gives the tokens the engine has sampled since the rollout began
        (its ``EngineStats.tokens_sampled``): read at each redraw, shown once above 0."""
        with self._lock:
            self._tokens = read

    def complete(self) -> None:
        """Every env has its trajectory (the driver checked): the count is exact."""
        with self._lock:
            before = self.finished
            self.finished = self.total
            self._show(self.finished - before)

    def __enter__(self) -> "RolloutProgress":
        return self

    # ----- what is shown ---------------------------------------------------------------
    @property
    def tokens(self) -> int:
        """The tokens sampled since the rollout began, as ``watch_tokens`` reads them (0: not watched)."""
        return self._tokens() if self._tokens is not None else 0

    def describe(self) -> str:
        tokens = self.tokens
        return (f"[Progress] {self.split}: {self.finished}/{self.total} envs finished | {self.turns} turns | "
                f"engine batch {self.batch_size}" + (f" | {tokens} tokens sampled" if tokens else ""))

    def postfix(self) -> str:
        tokens = self.tokens
        return f"turns={self.turns}, batch={self.batch_size}" + (f", tokens={tokens}" if tokens else "")
