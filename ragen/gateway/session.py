"""Sessions: one per episode, each with its own id, key, records and token history.

``Sessions`` opens them (at most ``max_sessions`` at once: the next is a 429 with
``Retry-After``), finds them by id and key (an unknown or closed one is a 404, a
missing or wrong key a 401), closes them (a closed session refuses every later call
and is never brought back) and expires those idle past ``ttl_s``, counted and logged.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from ragen.gateway.api_error import ApiError
from ragen.gateway.record import CallRecord
from ragen.gateway.segments import SessionTokens
from ragen.llm.chat_tokens import ChatTokens

logger = logging.getLogger(__name__)

_CLOSED_KEPT = 4096  # closed session ids remembered, so a late call hears "closed" rather than "unknown"


@dataclass(eq=False)
class Session:
    """One session: its calls' records and token history, and how many calls it has in flight."""

    id: str
    key: str = field(repr=False)
    tokens: SessionTokens
    seed: int = 0  # the request key's seed and env id: each call's sampling seed derives from them
    env_id: int = 0
    records: list[CallRecord] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # calls, segments, breaks/<cause>, tokens_in, tokens_out
    last_used: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    closed: bool = False
    overrides_logged: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(self, endpoint: str, limit: int) -> CallRecord:
        """A new call's record; 429 when ``limit`` calls are in flight already."""
        with self.lock:
            if self.closed:
                raise ApiError(404, f"session {self.id} is closed", code="session_closed")
            if self.in_flight >= limit:
                raise ApiError(429, f"session {self.id} has {limit} calls in flight, this gateway's bound "
                               "(gateway.max_calls_per_session)", code="too_many_calls", retry_after_s=1)
            self.in_flight += 1
            self.last_used = time.monotonic()
            record = CallRecord(index=len(self.records), endpoint=endpoint, started_at=time.time())
            self.records.append(record)
            return record

    def end(self, record: CallRecord) -> None:
        """The call ended (answered or failed): counted, and its slot freed."""
        with self.lock:
            self.in_flight -= 1
            self.last_used = time.monotonic()
            self.counts["calls"] += 1
            if record.error is not None:
                self.counts["errors"] += 1
            if record.cause is not None:
                self.counts["segments"] += 1
                if record.cause != "first":
                    self.counts[f"breaks/{record.cause}"] += 1
            self.counts["tokens_in"] += len(record.prompt_added)
            self.counts["tokens_out"] += len(record.response_ids)

    def count(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1

    def metrics(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)


class Sessions:
    """The open sessions of a gateway."""

    def __init__(self, chat: ChatTokens, max_sessions: int, ttl_s: float | None,
                 on_close: Callable[[Session], None] | None = None) -> None:
        self.chat = chat
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.on_close = on_close  # told of every session that closes (the --record writer)
        self._open: dict[str, Session] = {}
        self._closed: dict[str, None] = {}  # insertion-ordered: the oldest forgotten first
        self._totals: Counter = Counter()  # the counts of the sessions closed
        self.closed_count = 0
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self.expired = 0

    def open(self, seed: int | None = None, env_id: int | None = None) -> Session:
        """A new session; 429 when ``max_sessions`` are open."""
        self.expire()
        with self._lock:
            if len(self._open) >= self.max_sessions:
                raise ApiError(429, f"{self.max_sessions} sessions are open, this gateway's bound "
                               "(gateway.max_sessions): close one or retry later", code="too_many_sessions",
                               retry_after_s=1)
            number = next(self._numbers)
            session = Session(id=secrets.token_hex(8), key="sk-ragen-" + secrets.token_urlsafe(24),
                              tokens=SessionTokens(self.chat), seed=number if seed is None else seed,
                              env_id=number if env_id is None else env_id)
            self._open[session.id] = session
        return session

    def get(self, session_id: str, key: str | None) -> Session:
        """The open session ``session_id`` whose key is ``key``: 401 without the key, 404 for an
        unknown or closed session."""
        with self._lock:
            session = self._open.get(session_id)
            closed = session_id in self._closed
        if session is None:
            raise ApiError(404, f"session {session_id} is {'closed' if closed else 'unknown'}",
                           code="session_closed" if closed else "session_not_found")
        if key is None or not hmac.compare_digest(key.encode(), session.key.encode()):
            raise ApiError(401, "a session's calls need its key as the bearer token (Authorization: Bearer <key>)"
                           if key is None else f"the key is not session {session_id}'s", code="invalid_api_key")
        return session

    def close(self, session_id: str) -> Session | None:
        """Closes the session; it refuses every later call. None when it was not open."""
        with self._lock:
            session = self._open.pop(session_id, None)
            if session is None:
                return None
            self._closed[session_id] = None
            while len(self._closed) > _CLOSED_KEPT:
                del self._closed[next(iter(self._closed))]
        with session.lock:
            session.closed = True
        with self._lock:
            self._totals.update(session.metrics())
            self.closed_count += 1
        if self.on_close is not None:
            self.on_close(session)
        return session

    def expire(self) -> int:
        """Closes the sessions idle past ``ttl_s`` (none in flight); how many."""
        if not self.ttl_s:
            return 0
        now = time.monotonic()
        with self._lock:
            idle = [s.id for s in self._open.values() if not s.in_flight and now - s.last_used > self.ttl_s]
        for session_id in idle:
            if self.close(session_id) is not None:
                self.expired += 1
                logger.info("gateway session %s expired after %.0f s idle (gateway.session_ttl_s)", session_id,
                            self.ttl_s)
        return len(idle)

    def __len__(self) -> int:
        return len(self._open)

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._open.values())

    def metrics(self) -> dict[str, int]:
        """Every session's counts summed (calls, segments, breaks by cause, tokens in and out, errors,
        the audits), closed ones too, with how many sessions are open, closed and expired."""
        with self._lock:
            total = Counter(self._totals)
            sessions = list(self._open.values())
        for session in sessions:
            total.update(session.metrics())
        return {**total, "sessions_open": len(sessions), "sessions_closed": self.closed_count,
                "sessions_expired": self.expired}
