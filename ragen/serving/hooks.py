"""What the work announced under one tag adds to serving (``Hooks``): handlers
of calls (``SharedLLMClient.call``; a call may open streams under the tag,
``Reply``), handlers of the counts workers attach to their messages
(``SharedLLMClient.note``), and an ``Observer`` told of every engine call and
of the requests it answers for the tag's streams. Observers and note handlers
run outside the manager's lock; their errors are logged and ignored, and the
manager decides nothing from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol


class Observer(Protocol):
    """Told what the engine does, for the streams of one announced tag."""

    def engine_call(self, size: int) -> None:
        """An engine call of ``size`` requests starts (told to every observer)."""

    def answered(self, n: int) -> None:
        """``n`` requests of the tag's streams were answered with completions."""


@dataclass(frozen=True)
class Reply:
    """A call's reply: ``payload`` (plain data) for the caller, and the
    ``streams`` the call opens on the caller's connection under its tag
    (counted against the tag's announcement)."""

    payload: Any = None
    streams: int = 0


@dataclass(frozen=True)
class Hooks:
    """What the work announced under one tag adds to serving, dropped at
    ``withdraw``. ``calls``: the handler of each kind of call, given its
    payload; it runs on the connection's thread under the manager's lock, so
    it is quick and never blocks. ``notes``: the handler of each count the
    workers attach to their messages, given the count. ``observer``: told of
    engine calls and answers."""

    calls: Mapping[str, Callable[[Any], Reply]] = field(default_factory=dict)
    notes: Mapping[str, Callable[[int], None]] = field(default_factory=dict)
    observer: Observer | None = None
