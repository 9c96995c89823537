"""Several engines of one kind behind one: replicas, routing and failover.

- ``Routing`` and ``Router`` (``ragen.llm.routing``): how requests are spread
  and which replica takes each one.
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
Replicas tell no streamed ids (``stream_tokens``: the base ``generate_reporting``
and ``submit_reporting``): each completion carries every id.
``make_engine`` builds these from ``engine.replicas`` (hf, scripted) or
``engine.base_urls`` (openai); see docs/engines.md.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ragen.llm.routing import NoReplicaLeft, Router, Routing, WaitForReplica
from ragen.llm.stats import EngineStats
from ragen.llm.types import (CLOSED_BEFORE_ANSWER, Completion, Engine, GenerationRequest, SamplingParams,
                              StreamingEngine, resolve)

logger = logging.getLogger(__name__)


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
