"""The coalescing policy: when to call the engine, and with which requests.

Requests from all workers queue up; ``Coalescer.decide(now)`` says "call the
engine now with these requests" or "wait until t". It is a plain object: no
socket, thread or clock of its own (the server calls it under its lock with
``time.monotonic()``; tests call it with a fake clock).

While the engine is idle it waits for more requests until every open stream
(a worker's micro-batch with work left) has one queued, the batch reaches
``max_batch_size``, or the wait budget is spent: ``coalesce_wait_s``, or more
when the engine has a larger fixed cost per call (``CallCostModel``, fitted
online on calls of about the size of the one being gathered; capped by
``max_coalesce_wait_s``, which is also the budget while that cost is not
known). Within that budget it waits only for the streams expected in it. A
connection (one worker) serves its streams one after another, so it is
modelled as a serial server (``StreamClock``): each idle stream is due one
"turn time" (env steps and prompt building, learned per connection; resets
learned apart) after the later of its answer and the stream before it. A
stream that will not be back before the budget runs out is not waited for;
one due within it is, until it comes or the budget is spent, even when it is
later than predicted. The driver ``announce``s how many streams the work it
dispatched will open, under a tag, so a worker that starts late is waited
for before it connects.

Why wait at all: on a GPU a call's time hardly depends on its size, so a turn
split over two calls costs a whole decode more. A fit of the fixed cost from
calls of one size is noise around 0 there, and a small misprediction splits a
turn in two; hence "unknown" (not 0) when call sizes are too alike, and
waiting for a late stream that is still within the budget. A line through far
apart sizes (a validation's call of 128 and a training call of 32 on a CPU)
puts the fixed cost near 0 too, which would split every later turn; hence a
fit on calls near the size.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

from ragen.llm.types import GenerationRequest, SamplingParams


class CallCostModel:
    """Engine call time as ``fixed + per_request * n``, fitted by least
    squares over recent calls (exponentially forgotten). ``fixed_s(near)`` is
    what one more call of about ``near`` requests costs beyond its requests (a
    GPU's per-step latency, which batching amortizes), fitted only on calls
    within a factor ``size_ratio`` of that size: an engine's time is not one
    line over every size (on a CPU a call of 16 can cost as much as one of 32,
    and one of 128 four times as much), and a line through far-apart sizes (a
    validation's call and a training call) puts the intercept near 0.
    None while the calls seen are too alike in size to tell the two apart
    (sizes within ``min_spread`` of their mean, or no calls): the intercept
    would be an extrapolation that timing noise decides."""

    min_spread = 0.25
    size_ratio = 2.0

    def __init__(self, decay: float = 0.95, history: int = 64) -> None:
        self.decay = decay
        self._calls: deque[tuple[int, float]] = deque(maxlen=history)  # beyond it a call's weight is negligible

    def add(self, n: int, seconds: float) -> None:
        self._calls.append((n, seconds))

    def fixed_s(self, near: float | None = None) -> float | None:
        """The fixed cost per call, from the calls of about ``near`` requests (None: from all)."""
        w = sn = st = snn = snt = 0.0
        weight = 1.0
        for n, seconds in reversed(self._calls):
            if near is None or near / self.size_ratio <= n <= near * self.size_ratio:
                w += weight
                sn += weight * n
                st += weight * seconds
                snn += weight * n * n
                snt += weight * n * seconds
            weight *= self.decay
        if w == 0.0:
            return None
        mean = sn / w
        det = w * snn - sn * sn  # w^2 * variance of the sizes
        if det <= (self.min_spread * mean * w) ** 2:
            return None
        slope = (w * snt - sn * st) / det
        return max(0.0, (st - slope * sn) / w)


@dataclass
class StreamClock:
    """One connection's open streams and how fast its worker comes back."""

    streams: int = 0
    tag: int | None = None  # the announced tag its open streams belong to
    # Streams with no request queued or in the engine: since when, and whether
    # since an answer (env steps next) or since opening (env resets next);
    # oldest first, the order in which the worker takes them up.
    idle: deque = field(default_factory=deque)
    last_request: float = 0.0
    # moving averages of the worker's time per stream: [after an answer, after opening]
    turn_s: list = field(default_factory=lambda: [None, None])

    def request_arrived(self, now: float) -> None:
        if self.idle:  # else a request outside any stream
            since, answered = self.idle.popleft()
            kind = 0 if answered else 1
            sample = now - max(since, self.last_request)  # the worker was busy with the stream before
            old = self.turn_s[kind]
            self.turn_s[kind] = sample if old is None else 0.7 * old + 0.3 * sample
        self.last_request = now

    def expected(self) -> list[float | None]:
        """When each idle stream is due, in the order the worker takes them
        up; None where there is no estimate."""
        out: list[float | None] = []
        t = self.last_request
        for since, answered in self.idle:
            per = self.turn_s[0 if answered else 1]
            if per is None:
                out.append(None)
                continue
            t = max(t, since) + per
            out.append(t)
        return out


@dataclass
class Pending:
    """A request list waiting for the engine; ``conn`` is whatever the server
    routes its answer by."""

    conn: Hashable
    ticket: int
    requests: list[GenerationRequest]
    sampling: SamplingParams
    arrived: float
    transit_in: float | None = None  # from the worker's send to ``arrived`` (both on one machine's clock)
    sampling_key: str = field(init=False)

    def __post_init__(self) -> None:
        self.sampling_key = json.dumps(self.sampling.to_dict(), sort_keys=True)  # one call, one sampling


@dataclass(frozen=True)
class Decision:
    """Call the engine with ``batch`` now, or (``batch`` None) wait until
    ``until`` (None: until something happens)."""

    batch: list[Pending] | None = None
    until: float | None = None


class Coalescer:
    """The queue of requests and the streams they come from; ``decide`` turns
    them into engine calls. Not thread-safe: its owner serialises calls."""

    def __init__(self, max_batch_size: int = 256, coalesce_wait_s: float = 0.0005,
                 max_coalesce_wait_s: float = 1.0) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if coalesce_wait_s < 0:
            raise ValueError(f"coalesce_wait_s must be >= 0, got {coalesce_wait_s}")
        self.max_batch_size = int(max_batch_size)
        self.coalesce_wait_s = float(coalesce_wait_s)
        self.max_coalesce_wait_s = float(max_coalesce_wait_s)
        self.cost = CallCostModel()
        self.engine_free_at = 0.0
        self.pending: deque[Pending] = deque()
        self.clocks: dict[Hashable, StreamClock] = {}
        # streams of dispatched work whose workers have not opened them yet, by tag
        self.announced: dict[int, int] = {}
        self._tags = 0

    # ----- what happens ----------------------------------------------------------
    def connect(self, conn: Hashable) -> None:
        self.clocks[conn] = StreamClock()

    def disconnect(self, conn: Hashable) -> None:
        """The connection is gone: its streams close and its queued requests are dropped."""
        self.clocks.pop(conn, None)
        self.pending = deque(p for p in self.pending if p.conn != conn)

    def open(self, conn: Hashable, n: int, tag: int | None, now: float, announced: bool = True) -> None:
        """``n`` streams open on ``conn`` under ``tag`` (``announced``: counted against its announcement)."""
        clock = self.clocks[conn]
        clock.streams += n
        clock.tag = tag
        if announced and tag in self.announced:
            self.announced[tag] -= n
        clock.idle.extend([(now, False)] * n)

    def close(self, conn: Hashable, n: int) -> None:
        clock = self.clocks[conn]
        n = min(n, clock.streams)
        clock.streams -= n
        for _ in range(min(n, len(clock.idle))):
            clock.idle.pop()  # a stream closes right after its last answer

    @property
    def open_streams(self) -> int:
        """Streams open over every connection."""
        return sum(clock.streams for clock in self.clocks.values())

    def announce(self, n_streams: int) -> int:
        """Work whose workers will open ``n_streams`` streams was dispatched;
        returns the tag they open them under."""
        self._tags += 1
        self.announced[self._tags] = n_streams
        return self._tags

    def withdraw(self, tag: int) -> None:
        """Expect none of the tag's streams any more (also the ones still open:
        work the driver gave up on would hold every later call to its full budget)."""
        self.announced.pop(tag, None)
        for clock in self.clocks.values():
            if clock.tag == tag and clock.streams:
                clock.streams = 0
                clock.idle.clear()

    def arrive(self, pending: Pending) -> None:
        clock = self.clocks.get(pending.conn)
        if clock is not None:
            clock.request_arrived(pending.arrived)
        self.pending.append(pending)

    def take_where(self, keep: Callable[[Pending], bool]) -> list[Pending]:
        """The queued request lists for which ``keep`` is true, out of the queue."""
        taken = [p for p in self.pending if keep(p)]
        if taken:
            self.pending = deque(p for p in self.pending if not keep(p))
        return taken

    def answered(self, counts: dict[Hashable, int], now: float) -> None:
        """``counts[conn]`` request lists of each connection were answered at ``now``."""
        for conn, n in counts.items():
            clock = self.clocks.get(conn)
            if clock is not None:
                clock.idle.extend([(now, True)] * max(0, min(n, clock.streams - len(clock.idle))))

    def call_done(self, n_requests: int, seconds: float, free_at: float) -> None:
        self.cost.add(n_requests, seconds)
        self.engine_free_at = free_at

    # ----- the decision ------------------------------------------------------------
    def budget_s(self, batch: float | None = None) -> float:
        """How long to hold the first request for others: up to what a separate
        call would cost (the fixed cost per call of about ``batch`` requests),
        so merging never loses more than it can save; ``max_coalesce_wait_s``
        while that cost is unknown."""
        fixed = self.cost.fixed_s(batch)
        if fixed is None:
            return self.max_coalesce_wait_s
        return max(self.coalesce_wait_s, min(self.max_coalesce_wait_s, fixed))

    def decide(self, now: float) -> Decision:
        if not self.pending:
            return Decision()
        # counted from when the engine became free: streams that fell out of
        # step (one half generating while the other steps) fall back in
        unopened = sum(n for n in self.announced.values() if n > 0)
        n_req = sum(len(p.requests) for p in self.pending)
        # the call it would be with every stream in, as large as the ones queued
        batch = n_req * max(len(self.pending), self.open_streams + unopened) / len(self.pending)
        deadline = max(self.pending[0].arrived, self.engine_free_at) + self.budget_s(batch)
        go = (len(self.pending) >= self.open_streams + unopened or n_req >= self.max_batch_size or now >= deadline
              or (not unopened and not self.expects_before(deadline)))
        return Decision(batch=self._take_batch()) if go else Decision(until=deadline)

    def expects_before(self, deadline: float) -> bool:
        """Whether an idle stream is due before ``deadline`` (or has no
        estimate yet). One that is late is still waited for: a worker's time
        per stream varies, and a split call costs more than the budget."""
        return any(due is None or due <= deadline for clock in self.clocks.values() for due in clock.expected())

    def _take_batch(self) -> list[Pending]:
        """The oldest request's sampling, with every queued request of the same
        sampling that fits in ``max_batch_size`` (the first always does)."""
        key = self.pending[0].sampling_key
        batch, size, rest = [], 0, deque()
        for p in self.pending:
            if p.sampling_key == key and (not batch or size + len(p.requests) <= self.max_batch_size):
                batch.append(p)
                size += len(p.requests)
            else:
                rest.append(p)
        self.pending = rest
        return batch
