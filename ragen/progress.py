"""ProgressDisplay: how long work shows how far it has got while it runs.

On a terminal it is a ``tqdm`` bar that appears only once the work has run
``delay_s`` (short work shows nothing) and is removed when it ends. Elsewhere
(a log file, a job scheduler) it never draws a bar, whose ``\\r`` redraws
would be glued to the log lines around them: the same reading goes out as
whole ``logger.info`` lines, after ``delay_s`` and then at most every
``log_every_s``. Besides the events, a ticker thread redraws every ``tick_s``,
so a long stretch without events (one long engine call, one long update)
still shows the time and whatever its ``postfix`` reads.

Subclasses (``RolloutProgress``, ``UpdateProgress``) hold the counts and say
how they read: ``describe()`` is the log line, ``postfix()`` the bar's text.
A display only reads counts, and an error in it is logged and swallowed,
never raised into the work it shows.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Callable, TextIO

logger = logging.getLogger(__name__)


class ProgressDisplay:
    """``total`` units of work, shown as a bar or as log lines (see the module docstring).

    ``terminal``: None asks ``file.isatty()``; ``disable``: count only, show nothing
    (tests, library callers). ``clock`` is for tests (a fake clock). Subclasses
    call ``_advance(n)`` under ``self._lock`` as units are done, and ``_show(0)``
    when anything else they show changed; ``log`` is the logger of their lines."""

    log = logger

    def __init__(self, total: int, desc: str, unit: str, *, delay_s: float = 2.0, log_every_s: float = 10.0,
                 file: TextIO | None = None, terminal: bool | None = None, disable: bool = False,
                 clock: Callable[[], float] = time.monotonic, tick_s: float | None = 1.0) -> None:
        self.total = int(total)
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

            self._bar = tqdm(total=self.total, desc=desc, unit=unit, delay=delay_s, file=file, leave=False,
                             dynamic_ncols=True, mininterval=0.5)
        self._stop = threading.Event()
        if tick_s and (self._bar is not None or self._log):
            threading.Thread(target=self._tick, args=(tick_s,), name="ragen-progress", daemon=True).start()

    # ----- what subclasses say ------------------------------------------------------
    def describe(self) -> str:
        """The reading as one log line."""
        raise NotImplementedError

    def postfix(self) -> str:
        """The reading beside the bar (the bar itself shows the count, the time and the rate)."""
        return ""

    # ----- life ----------------------------------------------------------------------
    def close(self) -> None:
        """The work ended (or failed): the bar goes away."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            bar, self._bar = self._bar, None
        if bar is not None:
            try:
                bar.close()
            except Exception:  # progress must never fail the work it shows
                logger.debug("closing the progress bar failed", exc_info=True)

    def __enter__(self) -> "ProgressDisplay":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- display (under the lock) ---------------------------------------------------
    def _tick(self, every_s: float) -> None:
        # Bounded: each wait ends after every_s, and close() sets the event.
        while not self._stop.wait(every_s):
            with self._lock:
                if self._bar is not None and self._clock() - self._start >= self.delay_s:
                    try:  # the elapsed time, and what postfix() reads, move even when no event comes
                        self._bar.set_postfix_str(self.postfix(), refresh=False)
                        self._bar.refresh()
                    except Exception:  # progress must never fail the work it shows
                        logger.debug("progress display failed", exc_info=True)
                else:
                    self._show(0)

    def _show(self, advanced: int) -> None:
        """Draw after ``advanced`` more units were done (0: something else changed)."""
        if self._closed:
            return
        try:
            if self._bar is not None:
                self._bar.set_postfix_str(self.postfix(), refresh=False)
                self._bar.update(advanced)  # redraws only past mininterval, and not before delay_s
            elif self._log:
                now = self._clock()
                if now - self._start < self.delay_s:
                    return
                if self._last_log is not None and now - self._last_log < self.log_every_s:
                    return
                self._last_log = now
                self.lines_logged += 1
                self.log.info("%s | %.0f s", self.describe(), now - self._start)
        except Exception:  # progress must never fail the work it shows
            logger.debug("progress display failed", exc_info=True)
