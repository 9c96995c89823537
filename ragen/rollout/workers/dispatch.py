"""The parallel rollout's own messages on the shared manager's connection.

The driver announces each rollout to the ``SharedLLMInferenceManager`` with
the hooks of a ``RolloutDispatch`` (``announced``): the rollout's
``GroupQueue``, handed out a chunk per ``take`` call (each chunk taken opens
one stream under the rollout's tag), its ``RolloutProgress``, told of the
engine calls, of the requests answered for the rollout's streams, and of the
envs finished that workers count on their messages, and, when it over-samples,
the count of groups ended whole: at ``enough`` the queue closes and the manager
answers the rollout's requests ``aborted`` (``SharedLLMInferenceManager.abort``).
In a worker, ``take_chunk``, ``report_finished`` and ``report_groups_done`` are
the ends of those messages on its ``SharedLLMClient``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from ragen.rollout.progress import RolloutProgress
from ragen.rollout.scheduler import GroupCount
from ragen.rollout.workers.schedule import GroupQueue
from ragen.serving import Hooks, Reply, SharedLLMClient, SharedLLMInferenceManager, wire

TAKE = "take"  # the call that hands a worker its next chunk of groups
FINISHED = "finished"  # the note of envs a worker finished
GROUPS_DONE = "groups_done"  # the note of groups a worker finished whole (over-sampling)


class RolloutDispatch:
    """One rollout's side of the shared manager: its groups (``queue``; none
    for work dispatched whole) and its ``progress`` (optional)."""

    def __init__(self, queue: GroupQueue | None = None, progress: RolloutProgress | None = None,
                 enough: int | None = None) -> None:
        self.queue = queue
        self.progress = progress
        self.count = None if enough is None else GroupCount(enough)
        self.stop: Callable[[], None] | None = None  # at enough groups (set once the rollout has its tag)

    def hooks(self) -> Hooks:
        calls = {TAKE: self._take} if self.queue is not None else {}
        notes = {FINISHED: self.progress.envs_finished} if self.progress is not None else {}
        if self.count is not None:
            notes[GROUPS_DONE] = self._groups_done
        return Hooks(calls=calls, notes=notes, observer=self if self.progress is not None else None)

    def _groups_done(self, n: int) -> None:
        if self.count.add(n) and self.stop is not None:
            self.stop()

    def _take(self, payload: Any) -> Reply:
        """The next chunk's group indices, which opens one stream; empty once all are handed out."""
        chunk = self.queue.take()
        return Reply(chunk, streams=1 if chunk else 0)

    # the manager's Observer
    def engine_call(self, size: int) -> None:
        self.progress.engine_batch(size)

    def answered(self, n: int) -> None:
        self.progress.answered(n)


@contextlib.contextmanager
def announced(shared: SharedLLMInferenceManager, n_streams: int, queue: GroupQueue | None = None,
              progress: RolloutProgress | None = None, enough: int | None = None) -> Iterator[int]:
    """The tag of a rollout whose workers open ``n_streams`` streams, for
    their clients (``SharedLLMClient.tag``): announced with the rollout's
    hooks, withdrawn at the end (its queue closed: nothing more is handed out).
    ``enough``: once the workers told that many groups ended whole, the queue
    closes and the rollout's requests are answered ``aborted``."""
    dispatch = RolloutDispatch(queue, progress, enough)
    tag = shared.announce(n_streams, dispatch.hooks())

    def stop() -> None:
        if queue is not None:
            queue.close()
        shared.abort(tag)

    dispatch.stop = stop
    try:
        yield tag
    finally:
        shared.withdraw(tag)
        if queue is not None:
            queue.close()


def take_chunk(client: SharedLLMClient) -> list[int]:
    """The next chunk of the client's rollout (indices into the groups the
    worker was given), which opens one stream; empty when none are left or
    the rollout was withdrawn."""
    chunk = client.call(TAKE)
    if chunk is None:
        return []
    if not isinstance(chunk, list) or not all(type(i) is int for i in chunk):
        client.reset()
        raise wire.ProtocolError(f"bad reply from the LLM manager at {client.address}: a chunk of groups must "
                                 f"be a list of integers, got {repr(chunk)[:80]}")
    return chunk


def report_finished(client: SharedLLMClient, n: int) -> None:
    """``n`` more of the worker's envs ended: counted on the client's next message."""
    client.note(FINISHED, n)


def report_groups_done(client: SharedLLMClient, n: int) -> bool:
    """``n`` more of the worker's groups ended whole: counted on the client's next message.
    The driver decides when there are enough (its answers then come ``aborted``): False."""
    client.note(GROUPS_DONE, n)
    return False
