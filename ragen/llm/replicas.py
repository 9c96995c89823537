"""Several engines of one kind behind one: replicas, routing and failover.

- ``Routing`` (``engine.routing``): how requests are spread.
- ``Router``: which replica takes each request. It sends a request to the
  replica with the fewest requests in flight (on a tie, the one sent fewest),
  except that a later turn of an episode goes back to the replica that
  answered its earlier turns (which holds its prefix in cache), and the first
  turn of a group member (same seed, same prompt) goes where its group's first
  member went, unless that replica has more than ``sticky_margin`` requests in
  flight above the least loaded one. A replica that fails is marked down and
  skipped; once its back-off has passed, one request probes it (the back-off
  doubles, up to ``probe_max_s``, while probes fail). For ``outage_wait_s``
  from a request's first failure (or its first finding every replica down),
  any replica may take it again, and while every replica is down it is told
  to wait for a probe (``WaitForReplica``); past that, it goes only to a
  replica it has not tried. Its decisions read only counts and a clock, so a
  test drives it with a fake clock.
- ``ReplicatedEngine`` (members that batch: a call's requests split among
  the replicas, which run their parts at once) and
  ``ReplicatedStreamingEngine`` (members that stream: each request routed on
  its own). A request whose replica fails is sent again to another replica
  with the same request (so the same seed: the same answer on a seeded
  engine); the failover is counted and named in the log. Once every replica
  has failed, the requests that find none wait for the probes: an outage of
  every replica shorter than ``outage_wait_s`` is waited out. When no replica
  is left (a request that has waited longer, or whose replicas up all failed
  it), the request fails with ``NoReplicaLeft``, naming each replica and its
  last error.

A completion records the replica that produced it (``Completion.replica``).
``make_engine`` builds these from ``engine.replicas`` (hf, scripted) or
``engine.base_urls`` (openai); see docs/engines.md.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ragen.config_reader import setting
from ragen.llm.stats import EngineStats
from ragen.llm.types import (CLOSED_BEFORE_ANSWER, Completion, Engine, EngineUnavailable, GenerationRequest,
                              SamplingParams, StreamingEngine, resolve)

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


class WaitForReplica(Exception):
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


class ReplicaSet:
    """What both replicated engines share: the members, the router, the policy version
    and the counts summed over the members (``stats()``). The first replica is the primary: the
    trainer trains the hf engine's model in place there."""

    def _setup(self, replicas: Sequence[Engine], names: Sequence[str] | None, routing: Routing) -> None:
        if not replicas:
            raise ValueError("engine.replicas must be >= 1")
        self.replicas = list(replicas)
        self.router = Router(names or [f"{i}" for i in range(len(self.replicas))], routing)
        self.primary = self.replicas[0]
        self.name = self.primary.name
        self.returns_logprobs = self.primary.returns_logprobs
        self.chat = self.primary.chat
        self.vocab_size = self.primary.vocab_size
        self.closing = False  # close() under way: requests the replicas cancel are not failovers

    @property
    def policy_version(self) -> int:
        return self.primary.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        if "replicas" in self.__dict__:  # Engine.__init__ sets it before the members exist
            for replica in self.replicas:
                replica.policy_version = version

    def bump_policy_version(self) -> int:
        versions = [replica.bump_policy_version() for replica in self.replicas]
        return versions[0]

    def load_weights(self, named_tensors: Any, skip_primary: bool = False) -> int:
        """Push the weights into every replica (``skip_primary``: the primary holds them,
        the trainer updated its model in place); every replica's version is bumped."""
        weights = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        for replica in self.replicas:
            if skip_primary and replica is self.primary:
                replica.bump_policy_version()
            else:
                replica.load_weights(weights)
        return self.policy_version

    # The trainer's view of the hf primary
    @property
    def model(self) -> Any:
        return self.primary.model

    @property
    def tokenizer(self) -> Any:
        return self.primary.tokenizer

    def stats(self) -> EngineStats:
        """The members' counts summed, with the router's (``Router.counts``)."""
        return EngineStats.summed([replica.stats() for replica in self.replicas], self.router.counts())

    def replica_counts(self) -> dict[str, float]:
        return self.router.counts()

    # the scripted streaming engine's decode steps and the requests running summed over them
    # (0 for members that run no decode steps of their own)
    steps = property(lambda self: sum(getattr(replica, "steps", 0) for replica in self.replicas))
    running_sum = property(lambda self: sum(getattr(replica, "running_sum", 0) for replica in self.replicas))

    def release_cache(self) -> None:
        self.router.forget_sessions()
        for replica in self.replicas:
            replica.release_cache()

    def close(self) -> None:
        self.closing = True
        for replica in self.replicas:
            replica.close()


class ReplicatedEngine(ReplicaSet, Engine):
    """Replicas that batch: each call's requests are routed, and every replica answers
    its part in a thread of its own at the same time; see the module docstring."""

    def __init__(self, replicas: Sequence[Engine], names: Sequence[str] | None = None,
                 routing: Routing = Routing()) -> None:
        super().__init__()
        self._setup(replicas, names, routing)
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="ragen-replica")
        self._closed = threading.Event()  # ends a wait for a probe

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        answers: list[Completion | None] = [None] * len(requests)
        tried: list[set[int]] = [set() for _ in requests]
        since: list[float | None] = [None] * len(requests)  # when each first failed or waited
        todo = list(range(len(requests)))
        while todo:
            parts, waiting, wait_s = self._route(requests, todo, tried, since)
            if not parts:  # every replica down: wait for a probe to fall due (the router bounds the wait)
                if self._closed.wait(wait_s):
                    raise RuntimeError(CLOSED_BEFORE_ANSWER)
                todo = waiting
                continue
            # the waiting requests go in the next round, when the replicas taking this round's
            # (probes among them, once every replica has failed) have answered or failed
            calls = {self._pool.submit(self.replicas[i].generate, [requests[k] for k in part], sampling): i
                     for i, part in parts.items()}
            for i in calls.values():
                self.router.called(i)
            # unbounded: each replica's call returns or raises; the serving layer bounds a call
            # with agent_proxy.engine_timeout_s
            wait(calls)
            todo = waiting
            for call, i in calls.items():
                part = parts[i]
                error = call.exception()
                if error is None:
                    completions = call.result()
                    if len(completions) != len(part):
                        error = RuntimeError(f"answered {len(completions)} completions for {len(part)} requests")
                if error is not None:
                    self.router.failed(i, error, len(part))
                    for k in part:
                        tried[k].add(i)
                        since[k] = self.router.clock() if since[k] is None else since[k]
                    todo += part
                    continue
                for k, completion in zip(part, completions):
                    self.router.done(i, completion)
                    answers[k] = dataclasses.replace(completion, replica=i)
        return answers  # type: ignore[return-value]  # every request answered, or NoReplicaLeft raised

    def _route(self, requests: Sequence[GenerationRequest], todo: list[int], tried: list[set[int]],
               since: list[float | None]) -> tuple[dict[int, list[int]], list[int], float]:
        """The requests ``todo`` by the replica each goes to, those that wait for the next round,
        and how long to wait when none goes anywhere; ``NoReplicaLeft`` when none can go anywhere
        and one has no replica left."""
        parts: dict[int, list[int]] = {}
        waiting: list[int] = []  # no replica for them now
        refused: NoReplicaLeft | None = None
        wait_s = float("inf")
        for k in todo:
            try:
                parts.setdefault(self.router.pick(requests[k], tried[k], since[k]), []).append(k)
            except WaitForReplica as told:  # every replica down
                since[k] = told.since
                waiting.append(k)
                wait_s = min(wait_s, told.retry_in_s)
            except NoReplicaLeft as exc:
                refused = exc
                waiting.append(k)
        if refused is not None and not parts:  # no replica takes any of them
            raise refused
        return parts, waiting, wait_s

    def close(self) -> None:
        super().close()
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(eq=False)
class _Routed:
    """A request in flight through the replicas: the caller's future, and where it went."""

    future: Future
    request: GenerationRequest
    sampling: SamplingParams
    tried: set[int]
    inner: Future | None = None  # the request in the replica it went to last
    since: float | None = None  # when it first failed or waited for a replica


class ReplicatedStreamingEngine(ReplicaSet, StreamingEngine):
    """Replicas that stream: each request routed on its own, its completion handed back
    as soon as its replica answers; see the module docstring."""

    def __init__(self, replicas: Sequence[StreamingEngine], names: Sequence[str] | None = None,
                 routing: Routing = Routing()) -> None:
        super().__init__()
        self._setup(replicas, names, routing)
        # requests that found no replica while every replica was down: routed again when a probe is
        # answered, or when the wake-up timer fires (a probe falls due, or the outage wait ends)
        self._parked: list[_Routed] = []
        self._park_lock = threading.Lock()
        self._wake: threading.Timer | None = None
        self._wake_at = 0.0

    def submit(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Future]:
        routed = [_Routed(Future(), r, sampling, set()) for r in requests]
        for entry in routed:
            # a weak reference: the entry holds its future, and a callback holding the entry would
            # make a cycle that keeps both (and the completion) until a full collection
            entry.future.add_done_callback(lambda future, ref=weakref.ref(entry): self._cancel_inner(future, ref()))
            self._send(entry)
        return [entry.future for entry in routed]

    def _send(self, entry: _Routed) -> None:
        """Route ``entry`` (``Router.pick``); park it while no replica is up and a probe is in
        flight or may fall due; fail it when none is left."""
        while not entry.future.done():
            with self._park_lock:  # a probe answered meanwhile routes the parked requests after this
                if self.closing:  # close() has failed the parked requests, or is about to
                    resolve(entry.future, error=RuntimeError(CLOSED_BEFORE_ANSWER))
                    return
                probing = self.router.probing()
                try:
                    index = self.router.pick(entry.request, entry.tried, entry.since)
                except WaitForReplica as told:  # every replica down
                    entry.since = told.since
                    self._parked.append(entry)
                    self._wake_in(told.retry_in_s)
                    return
                except NoReplicaLeft as exc:
                    if probing:  # after every replica failed: wait for the probe's answer
                        self._parked.append(entry)
                    else:
                        resolve(entry.future, error=exc)
                    return
            try:
                inner = self.replicas[index].submit([entry.request], entry.sampling)[0]
            except Exception as exc:  # the replica refuses at once (closed): the next one
                self._failover(entry, index, exc)
                continue
            entry.inner = inner
            inner.add_done_callback(lambda future, entry=entry, index=index: self._answered(entry, index, future))
            return

    def _wake_in(self, delay_s: float) -> None:
        """Route the parked requests again in ``delay_s`` (the park lock held), unless an
        earlier wake-up is set."""
        at = time.monotonic() + delay_s
        if self._wake is not None:
            if self._wake_at <= at:
                return
            self._wake.cancel()
        self._wake, self._wake_at = threading.Timer(delay_s, self._woken), at
        self._wake.daemon = True
        self._wake.start()

    def _woken(self) -> None:
        with self._park_lock:
            if self._wake is threading.current_thread():
                self._wake = None
        self._unpark()

    def close(self) -> None:
        super().close()
        with self._park_lock:
            if self._wake is not None:
                self._wake.cancel()
        self._unpark()  # requests still waiting for a probe fail now

    def _answered(self, entry: _Routed, index: int, inner: Future) -> None:
        entry.inner = None  # done: nothing to cancel, and no cycle through its callback
        try:
            self._settle_answer(entry, index, inner)
        finally:
            self._unpark()  # a replica's state may have changed: the parked requests try again

    def _unpark(self) -> None:
        with self._park_lock:
            parked, self._parked = self._parked, []
        for entry in parked:
            if self.closing:
                resolve(entry.future, error=RuntimeError(CLOSED_BEFORE_ANSWER))
            else:
                self._send(entry)

    def _settle_answer(self, entry: _Routed, index: int, inner: Future) -> None:
        if entry.future.cancelled() or self.closing:  # the caller gave up on it, or the engine closes
            self.router.cancelled(index)
            resolve(entry.future, error=RuntimeError(CLOSED_BEFORE_ANSWER))
            return
        # a replica that cancels a request itself (closed) failed it
        error = CancelledError(f"replica {self.router.replicas[index].name} cancelled it") \
            if inner.cancelled() else inner.exception()
        if error is None:
            completion = inner.result()
            self.router.done(index, completion)
            resolve(entry.future, dataclasses.replace(completion, replica=index))
            return
        self._failover(entry, index, error)
        self._send(entry)

    def _failover(self, entry: _Routed, index: int, error: BaseException) -> None:
        entry.tried.add(index)
        entry.since = self.router.clock() if entry.since is None else entry.since
        self.router.failed(index, error)
        logger.info("the request of env %s turn %s goes from replica %s to another (%s)", entry.request.env_id,
                    entry.request.turn, self.router.replicas[index].name, error)

    @staticmethod
    def _cancel_inner(future: Future, entry: _Routed | None) -> None:
        inner = None if entry is None else entry.inner  # None: answered, or nothing holds the entry now
        if future.cancelled() and inner is not None:
            inner.cancel()


def replicate(builders: Sequence[tuple[str, Callable[[], Engine]]], routing: Routing = Routing()) -> Engine:
    """One engine over the replicas ``builders`` make (``(name, build)`` each): streaming
    when they stream. A replica that fails to build closes those built before it."""
    replicas: list[Engine] = []
    try:
        for _, build in builders:
            replicas.append(build())
    except BaseException:
        for replica in replicas:
            replica.close()
        raise
    names = [name for name, _ in builders]
    logger.info("%d replicas of engine %r: %s", len(replicas), replicas[0].name, ", ".join(names))
    if all(replica.streams for replica in replicas):
        return ReplicatedStreamingEngine(replicas, names, routing)  # type: ignore[arg-type]
    return ReplicatedEngine(replicas, names, routing)
