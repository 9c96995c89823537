"""RolloutProgress: how far one rollout has got, shown while it runs.

The driver makes one per rollout with the number of envs asked for. It is
told three things as they happen: envs finished (``envs_finished``), requests
answered by the engine, i.e. turns (``answered``), and the size of the latest
engine call (``engine_batch``). The sequential loop tells it directly; in the
parallel rollout the driver's ``SharedLLMInferenceManager`` does, from the
requests it answers and the finished-env counts that workers add to the
messages they send anyway (``wire``).

On a terminal it is a ``tqdm`` bar on stderr that appears only once the
rollout has run ``delay_s`` (short rollouts show nothing) and is removed when
the rollout ends, where the per-step summary line takes over. Elsewhere (a log
file, a job scheduler) the same reading goes out as a ``logger.info`` line,
after ``delay_s`` and then at most every ``log_every_s``. Besides the events,
a ticker thread redraws every ``tick_s``, so one long engine call (a whole
Bandit rollout is one) still shows the batch it is running and the time.

Progress only reads counts: it never changes a trajectory, and its calls are
cheap (a lock and a few additions; the bar redraws at most every 0.5 s). An
error in it is logged and swallowed, never raised into the rollout.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Callable, TextIO

logger = logging.getLogger(__name__)


class RolloutProgress:
    """Counts of one rollout, shown as a bar or as log lines.

    ``terminal``: None asks ``file.isatty()``; ``disable``: count only, show
    nothing (tests, library callers). ``clock`` is for tests (a fake clock)."""

    def __init__(self, total: int, split: str = "rollout", *, delay_s: float = 2.0, log_every_s: float = 10.0,
                 file: TextIO | None = None, terminal: bool | None = None, disable: bool = False,
                 clock: Callable[[], float] = time.monotonic, tick_s: float | None = 1.0) -> None:
        self.total = int(total)
        self.split = split
        self.finished = 0
        self.turns = 0
        self.batch_size = 0
        self.delay_s = delay_s
        self.log_every_s = log_every_s
        self.lines_logged = 0
        self._clock = clock
        self._start = clock()
        self._last_log: float | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._bar: Any = None
        file = file if file is not None else sys.stderr
        if terminal is None:
            isatty = getattr(file, "isatty", None)
            terminal = bool(isatty and isatty())
        self._log = not disable and not terminal
        if not disable and terminal:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=f"rollout {split}", unit="env", delay=delay_s, file=file,
                             leave=False, dynamic_ncols=True, mininterval=0.5)
        self._stop = threading.Event()
        if tick_s and (self._bar is not None or self._log):
            threading.Thread(target=self._tick, args=(tick_s,), name="ragen-progress", daemon=True).start()

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

    def complete(self) -> None:
        """Every env has its trajectory (the driver checked): the count is exact."""
        with self._lock:
            before = self.finished
            self.finished = self.total
            self._show(self.finished - before)

    def close(self) -> None:
        """The rollout ended (or failed): the bar goes away."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            bar, self._bar = self._bar, None
        if bar is not None:
            try:
                bar.close()
            except Exception:  # progress must never fail a rollout
                logger.debug("closing the progress bar failed", exc_info=True)

    def __enter__(self) -> "RolloutProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def describe(self) -> str:
        return (f"[Progress] {self.split}: {self.finished}/{self.total} envs finished | {self.turns} turns | "
                f"engine batch {self.batch_size}")

    # ----- display (under the lock) ---------------------------------------------------
    def _tick(self, every_s: float) -> None:
        # Bounded: each wait ends after every_s, and close() sets the event.
        while not self._stop.wait(every_s):
            with self._lock:
                if self._bar is not None and self._clock() - self._start >= self.delay_s:
                    try:
                        self._bar.refresh()  # the elapsed time moves even when no event comes
                    except Exception:  # progress must never fail a rollout
                        logger.debug("progress display failed", exc_info=True)
                else:
                    self._show(0)

    def _show(self, advanced: int) -> None:
        if self._closed:
            return
        try:
            if self._bar is not None:
                self._bar.set_postfix_str(f"turns={self.turns}, batch={self.batch_size}", refresh=False)
                self._bar.update(advanced)  # redraws only past mininterval, and not before delay_s
            elif self._log:
                now = self._clock()
                if now - self._start < self.delay_s:
                    return
                if self._last_log is not None and now - self._last_log < self.log_every_s:
                    return
                self._last_log = now
                self.lines_logged += 1
                logger.info("%s | %.0f s", self.describe(), now - self._start)
        except Exception:  # progress must never fail a rollout
            logger.debug("progress display failed", exc_info=True)
