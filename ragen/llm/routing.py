"""Which replica takes each request: ``Routing`` (``engine.routing``), how requests are
spread, and ``Router``, the policy.

``Router`` sends a request to the replica with the fewest requests in flight (on
a tie, the one sent fewest), except that a later turn of an episode goes back to
the replica that answered its earlier turns (which holds its prefix in cache),
and the first turn of a group member (same seed, same prompt) goes where its
group's first member went, unless that replica has more than ``sticky_margin``
requests in flight above the least loaded one. A replica that fails is marked
down and skipped; once its back-off has passed, one request probes it (the
back-off doubles, up to ``probe_max_s``, while probes fail). For
``outage_wait_s`` from a request's first failure (or its first finding every
replica down), any replica may take it again, and while every replica is down it
is told to wait for a probe (``WaitForReplica``); past that, it goes only to a
replica it has not tried. Its decisions read only counts and a clock, so a test
drives it with a fake clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ragen.config_reader import setting
from ragen.errors import RagenError
from ragen.llm.types import Completion, EngineUnavailable, GenerationRequest

logger = logging.getLogger(__name__)

MAX_SESSIONS = 100_000  # episodes whose replica is remembered (least recently routed forgotten first)


@dataclass(frozen=True)
class Routing:
    """``engine.routing``: how requests are spread over replicas."""

    # a later turn goes back to its episode's replica unless that one has more than this many
    # requests in flight above the least loaded replica
    sticky_margin: int = setting(8, minimum=0)
    probe_s: float = setting(1.0, above=0.0)  # first wait before a failed replica is tried again
    probe_max_s: float = setting(30.0, above=0.0)  # the most the wait grows to (doubling per failed probe)
    # a request that failed, or found every replica down, waits this long for a replica to take it
    # (probes bring them back), then fails with NoReplicaLeft; 0: no wait
    outage_wait_s: float = setting(10.0, minimum=0.0)


class NoReplicaLeft(EngineUnavailable):
    """Every replica a request could go to has failed."""


class WaitForReplica(RagenError):
    """Every replica is down, and the request has waited less than ``outage_wait_s`` since
    ``since``: it asks again in ``retry_in_s`` (a probe falls due, or its wait ends), or
    when a probe is answered."""

    def __init__(self, since: float, retry_in_s: float) -> None:
        super().__init__(f"every replica is down: ask again in {retry_in_s:.2f} s")
        self.since = since
        self.retry_in_s = retry_in_s


@dataclass
class ReplicaStats:
    """One replica's state in the router and what it has done."""

    name: str
    in_flight: int = 0
    routed: int = 0  # requests sent to it (ties between replicas go to the one sent fewer)
    down: bool = False
    retry_at: float = 0.0  # down: when a probe may go to it
    backoff_s: float = 0.0
    probing: bool = False  # down, with a probe request in flight
    last_error: str = ""
    requests: int = 0  # answered
    tokens: int = 0  # response tokens of those answers
    calls: int = 0  # engine calls (batch members)
    busy_s: float = 0.0  # time with a request in flight
    busy_since: float | None = None


def session_of(request: GenerationRequest) -> tuple[int, int]:
    """The episode a request belongs to: its turns share the key."""
    return (request.seed, request.env_id)


class Router:
    """Picks the replica of each request; see the module docstring. Thread-safe."""

    def __init__(self, names: Sequence[str], routing: Routing = Routing(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not names:
            raise ValueError("a router needs at least one replica")
        self.routing = routing
        self.clock = clock
        self.replicas = [ReplicaStats(name) for name in names]
        self.failovers = 0  # requests sent again after their replica failed
        self.later_turns = 0  # requests of an episode's later turns (routed before)
        self.returned = 0  # of those, routed to the episode's replica
        self._sessions: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._groups: OrderedDict[int, int] = OrderedDict()  # a seed's first turns: the replica they went to
        self._all_down = False  # every replica down (said once in the log)
        self._lock = threading.Lock()

    def pick(self, request: GenerationRequest, exclude: Iterable[int] = (), since: float | None = None) -> int:
        """The replica for ``request``, counted as in flight. ``exclude``: the replicas that
        failed it; ``since``: when it first failed or waited (None: it has not). Within
        ``outage_wait_s`` of that, any replica may take it, and ``WaitForReplica`` when every
        replica is down; past it, one not excluded, else ``NoReplicaLeft``."""
        with self._lock:
            now = self.clock()
            start = now if since is None else since
            patient = now - start < self.routing.outage_wait_s
            # while it waits, a replica that failed it and came back (or is due a probe) may take it
            excluded = set() if patient else set(exclude)
            live = [i for i, r in enumerate(self.replicas) if not r.down and i not in excluded]
            probe = next((i for i, r in enumerate(self.replicas)
                          if r.down and not r.probing and now >= r.retry_at and i not in excluded), None)
            session = session_of(request)
            home = self._sessions.get(session)
            if home is None and request.turn == 0:  # its group's members ask with the same prompt
                home = self._groups.get(request.seed)
            if probe is not None:  # a down replica's back-off has passed: this request probes it
                self.replicas[probe].probing = True
                chosen = probe
            elif not live:
                if patient:
                    raise WaitForReplica(start, self._retry_in(now, start))
                raise NoReplicaLeft(self._no_replica_message(now - start))
            else:
                least = min(live, key=lambda i: (self.replicas[i].in_flight, self.replicas[i].routed))
                sticky = (home in live and self.replicas[home].in_flight
                          <= self.replicas[least].in_flight + self.routing.sticky_margin)
                chosen = home if sticky else least
            if home is not None and request.turn > 0:
                self.later_turns += 1
                self.returned += chosen == home
            _remember(self._sessions, session, chosen)
            if request.turn == 0:
                _remember(self._groups, request.seed, chosen)
            replica = self.replicas[chosen]
            if replica.in_flight == 0:
                replica.busy_since = now
            replica.in_flight += 1
            replica.routed += 1
            return chosen

    def done(self, index: int, completion: Completion) -> None:
        """``index`` answered a request: it is up (a probe that succeeds brings it back)."""
        with self._lock:
            replica = self.replicas[index]
            self._release(replica)
            replica.requests += 1
            replica.tokens += len(completion.response_token_ids)
            if replica.down:
                replica.down = replica.probing = False
                replica.backoff_s = 0.0
                self._all_down = False
                logger.info("replica %s answers again: requests go to it", replica.name)

    def failed(self, index: int, error: BaseException | str, requests: int = 1) -> None:
        """``index`` failed ``requests`` requests, each sent again to another replica (a
        failover): it is down until its back-off has passed."""
        with self._lock:
            replica = self.replicas[index]
            for _ in range(requests):
                self._release(replica)
            self.failovers += requests
            replica.last_error = str(error) if isinstance(error, str) else f"{type(error).__name__}: {error}"
            if replica.down and not replica.probing:
                return  # an earlier failure marked it down: one back-off per failure spell
            replica.backoff_s = (min(replica.backoff_s * 2, self.routing.probe_max_s) if replica.down
                                 else self.routing.probe_s)
            replica.down, replica.probing = True, False
            now = self.clock()
            replica.retry_at = now + replica.backoff_s
            logger.warning("replica %s failed (%s): it is down, its requests go to the other replicas, and one "
                           "request probes it in %.1f s", replica.name, replica.last_error, replica.backoff_s)
            if not self._all_down and all(r.down for r in self.replicas):
                self._all_down = True
                logger.warning("every replica is down: requests wait up to %.1f s (engine.routing.outage_wait_s) "
                               "for a probe to bring one back", self.routing.outage_wait_s)

    def cancelled(self, index: int) -> None:
        """A request of ``index`` was cancelled by its caller: no longer in flight."""
        with self._lock:
            replica = self.replicas[index]
            self._release(replica)
            replica.probing = False

    def probing(self) -> bool:
        """Whether a probe is in flight to a replica that is down (its answer may bring it back)."""
        with self._lock:
            return any(r.down and r.probing for r in self.replicas)

    def forget_sessions(self) -> None:
        """Forget which replica each episode went to (no episode is running)."""
        with self._lock:
            self._sessions.clear()
            self._groups.clear()

    def counts(self) -> dict[str, float]:
        """Cumulative counts: per replica, and the failovers and returns to an episode's replica."""
        with self._lock:
            now = self.clock()
            out = {"engine/replica_failovers": float(self.failovers),
                   "engine/replica_later_turns": float(self.later_turns),
                   "engine/replica_returned": float(self.returned)}
            for i, r in enumerate(self.replicas):
                busy = r.busy_s + (now - r.busy_since if r.busy_since is not None else 0.0)
                out.update({f"engine/replica{i}_requests": float(r.requests),
                            f"engine/replica{i}_tokens": float(r.tokens),
                            f"engine/replica{i}_calls": float(r.calls),
                            f"engine/replica{i}_busy_s": busy})
            return out

    def called(self, index: int) -> None:
        with self._lock:
            self.replicas[index].calls += 1

    def _release(self, replica: ReplicaStats) -> None:
        replica.in_flight = max(0, replica.in_flight - 1)
        if replica.in_flight == 0 and replica.busy_since is not None:
            replica.busy_s += self.clock() - replica.busy_since
            replica.busy_since = None

    def _retry_in(self, now: float, since: float) -> float:
        """Until the next probe falls due, or the wait of a request waiting since ``since`` ends."""
        due = [r.retry_at for r in self.replicas if r.down and not r.probing]
        return max(0.0, min(due + [since + self.routing.outage_wait_s]) - now)

    def _no_replica_message(self, waited_s: float) -> str:
        now = self.clock()
        parts = []
        for i, r in enumerate(self.replicas):
            if r.down:
                state = f"down, probed again in {max(0.0, r.retry_at - now):.1f} s"
            else:
                state = "failed this request"  # up, but tried by this request already
            parts.append(f"{r.name}: {state}; last error: {r.last_error or '(none)'}")
        return (f"no replica can take the request (after {waited_s:.1f} s; engine.routing.outage_wait_s="
                f"{self.routing.outage_wait_s}): " + " | ".join(parts))


def _remember(homes: OrderedDict, key: Any, replica: int) -> None:
    """``key`` went to ``replica``; the least recently routed keys past ``MAX_SESSIONS`` are forgotten."""
    homes[key] = replica
    homes.move_to_end(key)
    if len(homes) > MAX_SESSIONS:
        homes.popitem(last=False)
