"""``PartialSink``: the ``TokenSink`` of one engine call in the manager, which sends each
streaming request's new ids to its worker as a partial (``messages.partials_frame``).

It is built only where a request of the call asked (``stream_tokens``): ``partial_sink``
gives None otherwise, and the engine is called as it always was. Each report goes out at
once, one frame a connection, through that connection's bounded queue
(``Connection.send_frame``): the engine's thread never waits for a peer, and a peer that
does not read is dropped. A partial that cannot be sent is let go (the completion that
follows carries every id); a sink never fails the engine call.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, Sequence

from ragen.serving import messages
from ragen.serving.stats import ManagerStats

logger = logging.getLogger(__name__)


class PartialSink:
    """Reports of one engine call (``TokenSink``): ``where`` maps a request's index in the call
    to its connection, its ticket and its index in that ticket's request list."""

    def __init__(self, where: dict[int, tuple[Any, int, int]], stats: ManagerStats, offset: int = 0) -> None:
        self.where = where
        self.stats = stats
        self.offset = offset

    def shifted(self, offset: int) -> PartialSink:
        """The sink of a part of the call whose first request is at ``offset`` in the call."""
        return PartialSink(self.where, self.stats, self.offset + offset)

    def __call__(self, new: dict[int, list[int]]) -> None:
        by_conn: dict[Hashable, list[tuple[int, int, list[int]]]] = {}
        for i, ids in new.items():
            target = self.where.get(self.offset + i)
            if target is not None and ids:
                conn, ticket, index = target
                by_conn.setdefault(conn, []).append((ticket, index, ids))
        for conn, partials in by_conn.items():
            if not getattr(conn, "alive", True):
                continue
            try:
                self.stats.add(bytes_out=conn.send_frame(messages.partials_frame(partials)))
            except Exception:  # noqa: BLE001 - a gone peer or an engine's odd ids: the completion carries them
                logger.debug("a partial for %s was not sent", conn, exc_info=True)


def partial_sink(pending: Sequence[Any], stats: ManagerStats) -> PartialSink | None:
    """The sink of an engine call of ``pending``'s request lists (``coalescer.Pending``, in call
    order), or None when none of their requests asked for partials."""
    where: dict[int, tuple[Any, int, int]] = {}
    at = 0
    for p in pending:
        for j, request in enumerate(p.requests):
            if request.stream_tokens:
                where[at + j] = (p.conn, p.ticket, j)
        at += len(p.requests)
    return PartialSink(where, stats) if where else None
