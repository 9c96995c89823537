"""reasoning-gym's scorers run in sandboxed processes, never in the rollout's: ``ScorerPool``.

A scorer evaluates what the model wrote (``answers.py`` names the datasets that do), and any scorer
may compute for long on a crafted answer while holding its interpreter. So each process (a trainer,
a rollout worker) scores through its own ``ScorerPool``: up to ``size`` sandboxed scorer processes
(``scorer.py``), started when first needed and kept for the next answers. A request's wall time is
bounded; a scorer past it is killed (the next request starts a fresh one), and the answer scores 0
with the reason. A scorer that dies, or replies out of turn, likewise. A reset asks a scorer first
for the length of its question (``question_chars``), so a dataset's time and memory on the env's
options are bounded there, not in the rollout's process. ``scorer_pool(limits)``:
this process's pool for those limits (thread-safe; a forked child starts its own; closed at exit).
"""

from __future__ import annotations

import base64
import json
import logging
import multiprocessing.util
import os
import pickle
import select
import threading
import time
from dataclasses import dataclass
from typing import Any

from ...errors import RagenError
from ..sandbox import Limits, Sandboxed, SandboxError, spawn_python

__all__ = ["QuestionError", "Score", "ScorerPool", "scorer_pool"]

logger = logging.getLogger(__name__)

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scorer.py")
START_S = 120.0  # a scorer's start: the sandbox, then importing reasoning-gym (about 1 s on an idle core)
LIFE_CPU_S = 600.0  # a scorer's CPU limit, for its whole life: the pool replaces it at half of that
_MAX_REPLY_BYTES = 64 * 1024
_STDERR_TAIL = 2000
POOL_SIZE = 4


@dataclass(frozen=True)
class Score:
    """An answer's score, 0..1; ``error``: why it is 0 without its scorer's verdict (None: the verdict)."""

    value: float
    error: str | None = None


class QuestionError(RagenError, RuntimeError):
    """A dataset gave no question for a reset's seed (it raised, ran past its time or died)."""


class _Lost(RagenError):
    """The scorer gave no reply to this request: it is killed, and the answer scores 0 with this reason."""


class _Scorer:
    """One sandboxed scorer process: a request line in, a reply line out."""

    def __init__(self, limits: Limits) -> None:
        self.box: Sandboxed = spawn_python([_SCRIPT], limits, packages=True)  # limits.wall_s: its start
        self.busy_s = 0.0  # wall time spent on requests: an upper bound of its CPU time
        self._buffer = b""
        self._stderr = b""
        self._reading = [self.box.proc.stdout.fileno(), self.box.proc.stderr.fileno()]
        self._ids = 0
        os.set_blocking(self.box.proc.stdin.fileno(), False)  # a write takes what fits, never waits
        try:
            ready = self._read_line(time.monotonic() + limits.wall_s, limits.wall_s)
        except _Lost as exc:
            self.close()
            raise SandboxError(f"reasoning-gym's scorer did not start: {exc}") from None
        if ready != {"ready": True}:
            self.close()
            raise SandboxError(f"reasoning-gym's scorer did not start: it said {ready!r}")

    def ask(self, request: dict[str, Any], wall_s: float) -> dict[str, Any]:
        """The scorer's reply to ``request``; ``_Lost`` if none came within ``wall_s``."""
        self._ids += 1
        self._stderr = b""  # what it says while scoring this answer
        line = (json.dumps({"id": self._ids, **request}) + "\n").encode("utf-8")
        start = time.monotonic()
        deadline = start + wall_s
        try:
            self._write(line, deadline, wall_s)
            reply = self._read_line(deadline, wall_s)
        finally:
            self.busy_s += time.monotonic() - start
        if self._buffer:
            raise _Lost("the scorer wrote more than its reply")
        if not isinstance(reply, dict) or reply.get("id") != self._ids:
            raise _Lost(f"the scorer's reply is not this request's: {str(reply)[:200]}")
        return reply

    def _write(self, data: bytes, deadline: float, wall_s: float) -> None:
        fd = self.box.proc.stdin.fileno()
        while data:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise _Lost(f"the scorer did not read the answer within {wall_s:g} s")
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise _Lost(self._died()) from None

    def _read_line(self, deadline: float, wall_s: float) -> Any:
        out = self.box.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Lost(f"the scorer ran past its {wall_s:g} s")
            for fd in select.select(self._reading, [], [], left)[0]:
                block = os.read(fd, 65536)
                if fd != out:
                    self._stderr = (self._stderr + block)[-_STDERR_TAIL:]
                    if not block:  # closed: its exit (or its own doing) shows on stdout
                        self._reading.remove(fd)
                elif not block:
                    raise _Lost(self._died())
                else:
                    self._buffer += block
            if len(self._buffer) > _MAX_REPLY_BYTES:
                raise _Lost(f"the scorer's reply is longer than {_MAX_REPLY_BYTES} bytes")
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            raise _Lost(f"the scorer's reply is not JSON: {line[:200]!r}") from None

    def _died(self) -> str:
        self.close()
        code = self.box.proc.returncode
        tail = self._stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit {code}"
        return f"the scorer died ({how}){': ' + tail[0][:300] if tail[0] else ''}"

    def alive(self) -> bool:
        return self.box.proc.poll() is None

    def close(self) -> None:
        self.box.close()


class ScorerPool:
    """Up to ``size`` sandboxed scorer processes of this process, started when needed and reused."""

    def __init__(self, limits: Limits, size: int = POOL_SIZE) -> None:
        self.limits = limits
        self.size = size
        self._idle: list[_Scorer] = []
        self._live = 0
        self._cond = threading.Condition()
        self._closed = False

    def score(self, dataset: str, options: dict[str, Any], seed: int, item: dict[str, Any], answer: str,
              wall_s: float) -> Score:
        """The score of ``answer`` to ``item`` by ``dataset`` (made with ``options`` and ``seed``), by a
        scorer given ``wall_s``."""
        request = {"dataset": dataset, "options": options, "seed": seed, "answer": answer,
                   "item": base64.b64encode(pickle.dumps(item)).decode("ascii")}
        try:
            reply = self._ask(request, wall_s)
        except _Lost as exc:
            logger.info("%s: the answer %r scores 0: %s", dataset, answer[:100], exc)
            return Score(0.0, str(exc))
        if "error" in reply:  # some scorers raise on text they cannot read
            logger.debug("%s: the answer %r scores 0: its scorer raised %s", dataset, answer[:100], reply["error"])
            return Score(0.0, f"the scorer raised {reply['error']}")
        value = reply.get("score")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            return Score(0.0, f"the scorer's score is not a number from 0 to 1: {str(value)[:100]}")
        return Score(float(value))

    def question_chars(self, dataset: str, options: dict[str, Any], seed: int, wall_s: float) -> int:
        """The length of the question ``dataset`` (made with ``options`` and ``seed``) asks, made by a
        scorer given ``wall_s``; ``QuestionError`` when it gives none."""
        try:
            reply = self._ask({"question": True, "dataset": dataset, "options": options, "seed": seed}, wall_s)
        except _Lost as exc:
            raise QuestionError(str(exc)) from None
        if "error" in reply:
            raise QuestionError(f"the dataset raised {reply['error']}")
        chars = reply.get("chars")
        if isinstance(chars, bool) or not isinstance(chars, int) or chars < 0:
            raise QuestionError(f"the scorer replied {str(reply)[:100]}, not a length")
        return chars

    def _ask(self, request: dict[str, Any], wall_s: float) -> dict[str, Any]:
        """A scorer's reply to ``request`` within ``wall_s``; ``_Lost`` (the scorer killed) when none came."""
        scorer = self._take()
        try:
            reply = scorer.ask(request, wall_s)
        except BaseException:  # _Lost, or an interrupt: the scorer's state is unknown, so it goes
            self._drop(scorer)
            raise
        self._give_back(scorer)
        return reply

    def _take(self) -> _Scorer:
        """An idle scorer that is still running, else a new one when fewer than ``size`` run, else wait."""
        while True:
            with self._cond:
                while not self._idle and self._live >= self.size and not self._closed:
                    self._cond.wait()
                if self._closed:
                    raise RuntimeError("ScorerPool.score after close()")
                scorer = self._idle.pop() if self._idle else None
                if scorer is None:
                    self._live += 1
            if scorer is None:
                try:
                    return _Scorer(self.limits)
                except BaseException:  # anything: its place is given up, then it is raised
                    with self._cond:
                        self._live -= 1
                        self._cond.notify()
                    raise
            if scorer.alive():
                return scorer
            logger.info("a reasoning-gym scorer process had ended while idle; starting another")
            self._drop(scorer)

    def _give_back(self, scorer: _Scorer) -> None:
        if scorer.busy_s > self.limits.cpu_s / 2:  # its CPU limit is for its life: a fresh one before it nears
            self._drop(scorer)
            return
        with self._cond:
            if not self._closed:
                self._idle.append(scorer)
                self._cond.notify()
                return
        self._drop(scorer)

    def _drop(self, scorer: _Scorer) -> None:
        scorer.close()
        with self._cond:
            self._live -= 1
            self._cond.notify()

    def close(self) -> None:
        """Kill every idle scorer; one still scoring is killed when it is given back."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._live -= len(idle)
            self._cond.notify_all()
        for scorer in idle:
            scorer.close()


_pools: dict[Limits, ScorerPool] = {}
_pools_lock = threading.Lock()
_closing_in: int | None = None  # the process whose exit closes its pools
_inherited: list[ScorerPool] = []  # a forked child's copies of its parent's pools: never used nor closed


def scorer_pool(limits: Limits) -> ScorerPool:
    """This process's pool of scorers under ``limits`` (made on first use; closed at the process's exit)."""
    global _closing_in
    with _pools_lock:
        if limits not in _pools:
            _pools[limits] = ScorerPool(limits)
        if _closing_in != os.getpid():  # at exit: by atexit, and in a multiprocessing child that os._exit()s
            multiprocessing.util.Finalize(None, _close_pools, exitpriority=0)
            _closing_in = os.getpid()
        return _pools[limits]


def _forget_parents_pools() -> None:
    """In a forked child: its parent's scorers and pipes are the parent's; the child starts its own."""
    global _pools_lock
    _pools_lock = threading.Lock()
    _inherited.extend(_pools.values())
    _pools.clear()


def _close_pools() -> None:
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


os.register_at_fork(after_in_child=_forget_parents_pools)
