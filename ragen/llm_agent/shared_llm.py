"""SharedLLMInferenceManager: one engine in the driver, served to every worker.

- The manager owns the one engine (the one the trainer updates) and a lock
  around every engine call (``engine_lock``; the trainer takes it to swap
  weights). It listens on a socket (loopback unless told otherwise); each
  client proves it holds the manager's random per-run key (HMAC over a nonce)
  before anything else is read.
- Coalescing: requests from all workers queue up, and one batcher thread turns
  them into engine calls. While the engine is idle it waits for more requests
  until every open stream (a worker's micro-batch with work left) has one
  queued, the batch reaches ``max_batch_size``, or the wait budget is spent:
  ``coalesce_wait_s``, or more when the engine has a larger fixed cost per call
  (``CallCostModel``, fitted online; capped by ``max_coalesce_wait_s``, which
  is also the budget while that cost is not known). Within
  that budget it waits only for the streams expected to arrive in it. A
  connection (one worker) serves its streams one after another, so it is
  modelled as a serial server: each idle stream is due one "turn time" (env
  steps and prompt building, learned per connection; resets learned apart)
  after the later of its answer and the stream before it. A stream that will
  not be back before the budget runs out is not waited for; one due within it
  is, until it comes or the budget is spent, even when it is later than
  predicted (a GPU engine turned a few ms of misprediction into a turn split
  over two calls of a whole decode each). The driver ``announce``s how many
  streams a rollout's shards will open, so a worker that starts its shard
  late is waited for before it connects. So the engine sees
  batches as large as the sequential loop gives it, a stream busy stepping envs
  does not hold the others back for longer than a separate call would cost,
  and the engine does not idle waiting for a stream that will come too late to
  share the call.
- ``SharedLLMClient`` is small and picklable (address and key); each process
  and thread opens its own connection on first use.

Wire format: frames of a 4-byte big-endian length and a pickle of plain data
(dicts, lists, strings, numbers), read by an unpickler that refuses every
class and function, so a frame can carry nothing but data (as safe as JSON,
and 5-8x cheaper to encode and decode: the full message history of every env
travels each turn).

- Client -> manager: ``{"op": "open"|"close", "n": k}`` (streams), or
  ``{"op": "gen", "ticket": t, "requests": [...], "sampling": {...}}``.
- Manager -> client: ``{"answers": [...]}``, one frame per connection and
  engine call (a worker's streams answered together wake it once); each answer
  is ``{"ticket": t, "completions": [...]}`` (without token ids: they stay in
  the driver) or ``{"ticket": t, "error": msg}``.

A malformed message gets an error reply and the connection goes on; an
oversized frame or a failed handshake closes that connection only.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import pickle
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ragen.llm.types import Completion, Engine, GenerationRequest, SamplingParams

logger = logging.getLogger(__name__)

_MAGIC = b"RAGEN1"
_NONCE_BYTES = 32
_HEADER = struct.Struct(">I")


class EngineError(RuntimeError):
    """The shared engine failed on a request (raised in the client)."""


class ProtocolError(RuntimeError):
    pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a frame may hold only plain data, not {module}.{name}")


def _loads(data: bytes) -> Any:
    """Plain data from a frame; ValueError for anything else."""
    try:
        return _DataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # truncated or foreign bytes fail in many ways
        raise ValueError(f"not a frame of plain data ({type(exc).__name__}: {exc})") from None


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _send_frame(sock: socket.socket, obj: Any) -> int:
    frame = _frame(obj)
    sock.sendall(frame)
    return len(frame)


def _recv_frame(sock: socket.socket, max_bytes: int) -> tuple[bytes, int]:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > max_bytes:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_bytes}")
    return _recv_exact(sock, n), n + _HEADER.size


def _wire(completion: Completion) -> dict[str, Any]:
    # Workers read the text, finish reason and policy version, never the token
    # ids (the trainer tokenizes trajectories itself): keep them out of the
    # reply, where they would be most of its bytes and of its encoding time.
    d = completion.to_dict()
    d["prompt_token_ids"] = []
    d["response_token_ids"] = []
    return d


def _digest(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()


@dataclass(eq=False)  # identity: one per connection
class _Conn:
    sock: socket.socket
    peer: str
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    streams: int = 0
    rollout: int | None = None  # the announced rollout its open streams belong to
    alive: bool = True
    # Streams of this connection with no request queued or in the engine: since
    # when, and whether since an answer (env steps next) or since opening (env
    # resets next); oldest first, the order in which the worker takes them up.
    idle: deque = field(default_factory=deque)
    last_request: float = 0.0
    # moving averages of the worker's time per stream: [after an answer, after opening]
    turn_s: list = field(default_factory=lambda: [None, None])

    def send(self, obj: Any) -> int:
        return self.send_frame(_frame(obj))

    def send_frame(self, frame: bytes) -> int:
        with self.send_lock:
            self.sock.sendall(frame)
        return len(frame)

    def request_arrived(self, now: float) -> None:
        if self.idle:  # else a plain generate() call, outside any stream
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
class _Pending:
    conn: _Conn
    ticket: int
    requests: list[GenerationRequest]
    sampling: SamplingParams
    sampling_key: str
    arrived: float


@dataclass
class ManagerStats:
    engine_calls: int = 0
    requests: int = 0
    engine_time_s: float = 0.0
    batch_sizes: deque = field(default_factory=lambda: deque(maxlen=8192))  # the most recent calls'
    call_spans: deque = field(default_factory=lambda: deque(maxlen=8192))  # (start, end), time.monotonic()
    messages_in: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    refused_clients: int = 0
    bad_messages: int = 0

    def snapshot(self) -> "ManagerStats":
        return ManagerStats(**{**self.__dict__, "batch_sizes": deque(self.batch_sizes, maxlen=8192),
                               "call_spans": deque(self.call_spans, maxlen=8192)})


class CallCostModel:
    """Engine call time as ``fixed + per_request * n``, fitted by least
    squares over recent calls (exponentially forgotten). ``fixed_s()`` is what
    one more call costs beyond its requests: a GPU's per-step latency, which
    batching amortizes.

    None while the calls seen are too alike in size to tell the two apart
    (sizes within ``min_spread`` of their mean, or no calls): the intercept
    would be an extrapolation that timing noise decides. On a GPU, where
    every call of a turn has the same size and a call's time depends on its
    prompts' lengths more than on their number, such a fit once came out
    near 0 and split a turn into two calls of a whole decode each."""

    min_spread = 0.25

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def add(self, n: int, seconds: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._n = self._n * d + n
        self._t = self._t * d + seconds
        self._nn = self._nn * d + n * n
        self._nt = self._nt * d + n * seconds

    def fixed_s(self) -> float | None:
        if self._w == 0.0:
            return None
        mean = self._n / self._w
        det = self._w * self._nn - self._n * self._n  # w^2 * variance of the sizes
        if det <= (self.min_spread * mean * self._w) ** 2:
            return None
        slope = (self._w * self._nt - self._n * self._t) / det
        return max(0.0, (self._t - slope * self._n) / self._w)


class SharedLLMInferenceManager:
    def __init__(
        self,
        engine: Engine,
        max_batch_size: int = 256,
        coalesce_wait_s: float = 0.002,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = 64 << 20,
        handshake_timeout_s: float = 5.0,
        max_coalesce_wait_s: float = 1.0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"agent_proxy.max_batch_size must be >= 1, got {max_batch_size}")
        if coalesce_wait_s < 0:
            raise ValueError(f"agent_proxy.coalesce_wait_s must be >= 0, got {coalesce_wait_s}")
        self.engine = engine
        self.engine_lock = threading.Lock()
        self.max_batch_size = int(max_batch_size)
        self.coalesce_wait_s = float(coalesce_wait_s)
        self.max_coalesce_wait_s = float(max_coalesce_wait_s)
        self.call_cost = CallCostModel()
        self._engine_free_at = 0.0
        self.max_message_bytes = int(max_message_bytes)
        self.handshake_timeout_s = handshake_timeout_s
        self.stats = ManagerStats()
        self._key = secrets.token_bytes(32)
        self._cond = threading.Condition()
        self._pending: deque[_Pending] = deque()
        self._streams = 0
        # streams of dispatched shards whose workers have not opened them yet, by rollout
        self._announced: dict[int, int] = {}
        self._rollouts = 0
        self._conns: set[_Conn] = set()
        self._closed = False
        self._listener = socket.create_server((host, port))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._threads = [
            threading.Thread(target=self._accept_loop, name="ragen-llm-accept", daemon=True),
            threading.Thread(target=self._batch_loop, name="ragen-llm-batcher", daemon=True),
        ]
        for t in self._threads:
            t.start()
        logger.info("shared LLM manager listening on %s:%d", *self.address)

    def __repr__(self) -> str:  # never shows the key
        return f"SharedLLMInferenceManager(address={self.address}, engine={type(self.engine).__name__})"

    def client(self, timeout_s: float | None = None) -> "SharedLLMClient":
        return SharedLLMClient(address=self.address, authkey=self._key, timeout_s=timeout_s)

    def announce(self, n_streams: int) -> int:
        """The driver dispatched shards whose workers will open ``n_streams``
        streams: the coalescer waits for them (within its budget) before they
        connect, so a worker that starts its shard late is not left out of the
        first call. Returns the id for ``SharedLLMClient.rollout`` and
        ``withdraw``."""
        with self._cond:
            self._rollouts += 1
            self._announced[self._rollouts] = n_streams
            return self._rollouts

    def withdraw(self, rollout: int) -> None:
        """The rollout's shards ended (or failed): expect none of its streams.
        Streams still open under it are a shard the driver gave up on (past its
        timeout, in a thread or a Dask task that cannot be stopped): waiting
        for them would hold every later engine call to its full wait budget.
        Their connection may still send requests; they are answered as usual."""
        with self._cond:
            self._announced.pop(rollout, None)
            for conn in self._conns:
                if conn.rollout == rollout and conn.streams:
                    self._streams -= conn.streams
                    conn.streams = 0
                    conn.idle.clear()
            self._cond.notify_all()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    # ----- connections ---------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return  # listener closed
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"),
                             name="ragen-llm-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        conn = _Conn(sock, peer)
        try:
            sock.settimeout(self.handshake_timeout_s)
            nonce = secrets.token_bytes(_NONCE_BYTES)
            sock.sendall(_MAGIC + nonce)
            answer = _recv_exact(sock, hashlib.sha256().digest_size)
            if not hmac.compare_digest(answer, _digest(self._key, nonce)):
                self.stats.refused_clients += 1
                logger.warning("refused a client from %s: wrong key", peer)
                return
            conn.send({"ok": True})
            sock.settimeout(None)
            with self._cond:
                self._conns.add(conn)
            while not self._closed:
                data, n = _recv_frame(sock, self.max_message_bytes)
                self.stats.messages_in += 1
                self.stats.bytes_in += n
                self._handle(conn, data)
        except ProtocolError as exc:
            self.stats.bad_messages += 1
            logger.warning("closing the connection from %s: %s", peer, exc)
        except (EOFError, OSError):
            pass  # the client went away (a worker that finished, died or timed out)
        finally:
            with self._cond:
                conn.alive = False
                self._conns.discard(conn)
                self._streams -= conn.streams
                conn.streams = 0
                self._pending = deque(p for p in self._pending if p.conn is not conn)
                self._cond.notify_all()
            try:
                sock.close()
            except OSError:
                pass

    def _handle(self, conn: _Conn, data: bytes) -> None:
        ticket = None
        try:
            msg = _loads(data)
            if not isinstance(msg, dict):
                raise ValueError("a message must be a dict")
            op = msg.get("op")
            if op in ("open", "close"):
                n = msg.get("n")
                if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 1 << 16:
                    raise ValueError(f"'n' must be a small non-negative integer, got {n!r}")
                rollout = msg.get("rollout")
                if rollout is not None and (not isinstance(rollout, int) or isinstance(rollout, bool)):
                    raise ValueError(f"'rollout' must be an integer, got {rollout!r}")
                with self._cond:
                    delta = n if op == "open" else -min(n, conn.streams)
                    conn.streams += delta
                    self._streams += delta
                    if op == "open":
                        conn.rollout = rollout
                        if rollout in self._announced:
                            self._announced[rollout] -= n
                    now = time.monotonic()
                    for _ in range(delta):
                        conn.idle.append((now, False))
                    for _ in range(min(-delta, len(conn.idle))):
                        conn.idle.pop()  # a stream closes right after its last answer
                    self._cond.notify_all()
                return
            if op != "gen":
                raise ValueError(f"unknown op {op!r}")
            ticket = msg.get("ticket")
            if not isinstance(ticket, int) or isinstance(ticket, bool):
                raise ValueError("'ticket' must be an integer")
            raw = msg.get("requests")
            if not isinstance(raw, list) or not all(isinstance(r, dict) for r in raw):
                raise ValueError("'requests' must be a list of objects")
            requests = [GenerationRequest.from_dict(r) for r in raw]
            for r in requests:
                if not isinstance(r.messages, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in r.messages
                ):
                    raise ValueError("each request needs 'messages': a list of {role, content}")
            sampling_raw = msg.get("sampling") or {}
            if not isinstance(sampling_raw, dict):
                raise ValueError("'sampling' must be an object")
            sampling = SamplingParams.from_dict(sampling_raw)
        except (ValueError, TypeError) as exc:
            self.stats.bad_messages += 1
            logger.warning("bad message from %s: %s", conn.peer, exc)
            conn.send({"answers": [{"ticket": ticket, "error": f"bad message: {exc}"}]})
            return
        if not requests:
            conn.send({"answers": [{"ticket": ticket, "completions": []}]})
            return
        now = time.monotonic()
        with self._cond:
            conn.request_arrived(now)
            self._pending.append(_Pending(conn, ticket, requests, sampling,
                                          json.dumps(sampling.to_dict(), sort_keys=True), now))
            self._cond.notify_all()

    # ----- batching ------------------------------------------------------------
    def _next_batch(self) -> list[_Pending] | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._pending:
                    n_req = sum(len(p.requests) for p in self._pending)
                    # Wait for the streams still stepping their envs up to what a
                    # separate call for them would cost (the engine's fixed cost per
                    # call), counted from when the engine became free: merging then
                    # never loses more than it can save, and streams that fell out of
                    # step (one half generating while the other steps) fall back in.
                    # While that cost is unknown, up to max_coalesce_wait_s: a call
                    # split in two can cost a whole decode.
                    fixed = self.call_cost.fixed_s()
                    budget = self.max_coalesce_wait_s if fixed is None else max(
                        self.coalesce_wait_s, min(self.max_coalesce_wait_s, fixed))
                    deadline = max(self._pending[0].arrived, self._engine_free_at) + budget
                    now = time.monotonic()
                    unopened = sum(n for n in self._announced.values() if n > 0)
                    if len(self._pending) >= self._streams + unopened or n_req >= self.max_batch_size \
                            or now >= deadline:
                        break
                    if not unopened and not self._expects_before(deadline):
                        break
                    self._cond.wait(deadline - now)
                else:
                    self._cond.wait()
            key = self._pending[0].sampling_key
            batch, size, rest = [], 0, deque()
            for p in self._pending:
                if p.sampling_key == key and (not batch or size + len(p.requests) <= self.max_batch_size):
                    batch.append(p)
                    size += len(p.requests)
                else:
                    rest.append(p)
            self._pending = rest
            return batch

    def _expects_before(self, deadline: float) -> bool:
        """Whether an idle stream is due before ``deadline`` (or has no
        estimate yet). One that is late is still waited for: a worker's time
        per stream varies, and a split call costs more than the budget."""
        return any(due is None or due <= deadline for conn in self._conns for due in conn.expected())

    def _batch_loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            requests = [r for p in batch for r in p.requests]
            answers: dict[_Conn, list[dict[str, Any]]] = {}
            try:
                if logger.isEnabledFor(logging.DEBUG):
                    turns = sorted({r.turn for r in requests})
                    logger.debug("engine call: %d requests from %d streams, turns %s, %.4f s after the first arrived",
                                 len(requests), len(batch), turns, time.monotonic() - batch[0].arrived)
                completions = self.generate(requests, batch[0].sampling)
            except Exception as exc:  # the engine failed: every waiting client hears it
                logger.exception("engine call failed for %d requests", len(requests))
                for p in batch:
                    answers.setdefault(p.conn, []).append({"ticket": p.ticket, "error": f"{type(exc).__name__}: {exc}"})
            else:
                i = 0
                for p in batch:
                    part = completions[i: i + len(p.requests)]
                    i += len(p.requests)
                    answers.setdefault(p.conn, []).append({"ticket": p.ticket, "completions": [_wire(c) for c in part]})
            self._reply(answers)

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        """One engine call (in chunks of ``max_batch_size``) under the engine lock."""
        out: list[Completion] = []
        with self.engine_lock:
            start = time.monotonic()
            t0 = time.perf_counter()
            for i in range(0, len(requests), self.max_batch_size):
                chunk = requests[i: i + self.max_batch_size]
                got = self.engine.generate(chunk, sampling)
                if len(got) != len(chunk):
                    raise RuntimeError(f"engine returned {len(got)} completions for {len(chunk)} requests")
                out += got
                self.stats.engine_calls += 1
                self.stats.batch_sizes.append(len(chunk))
            elapsed = time.perf_counter() - t0
            self.stats.engine_time_s += elapsed
            self.stats.requests += len(requests)
            self.call_cost.add(len(requests), elapsed)
            self._engine_free_at = time.monotonic()
            self.stats.call_spans.append((start, self._engine_free_at))
        return out

    def _reply(self, answers: dict[_Conn, list[dict[str, Any]]]) -> None:
        """One frame per connection, all encoded before any is sent: a woken
        worker takes a core at once, and the other workers' answers must not
        wait behind it."""
        frames = [(conn, _frame({"answers": a}), len(a)) for conn, a in answers.items() if conn.alive]
        now = time.monotonic()
        with self._cond:
            for conn, _, n in frames:
                for _ in range(min(n, conn.streams - len(conn.idle))):
                    conn.idle.append((now, True))
        for conn, frame, _ in frames:
            try:
                self.stats.bytes_out += conn.send_frame(frame)
            except OSError:
                pass  # the client left; its cleanup runs in its own thread

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            conns = list(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> "SharedLLMInferenceManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_LOCAL = threading.local()


@dataclass(frozen=True)
class SharedLLMClient:
    """Picklable handle on a manager; connections are per process and thread."""

    address: tuple[str, int]
    authkey: bytes = field(repr=False)
    timeout_s: float | None = None  # for one answer; None: wait as long as it takes
    rollout: int | None = None  # the announced rollout whose streams this client opens

    def _state(self) -> dict[str, Any]:
        cache = getattr(_LOCAL, "conns", None)
        if cache is None:
            cache = _LOCAL.conns = {}
        key = (os.getpid(), tuple(self.address), self.authkey)
        state = cache.get(key)
        if state is None:
            state = {"sock": self._connect(), "ticket": 0, "outstanding": set(), "inbox": deque()}
            cache[key] = state
        return state

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(tuple(self.address), timeout=30)
        hello = _recv_exact(sock, len(_MAGIC) + _NONCE_BYTES)
        if not hello.startswith(_MAGIC):
            raise ProtocolError(f"{self.address} is not a ragen LLM manager")
        sock.sendall(_digest(self.authkey, hello[len(_MAGIC):]))
        try:
            data, _ = _recv_frame(sock, 1 << 10)
        except EOFError:
            raise ConnectionRefusedError(f"the LLM manager at {self.address} refused the key") from None
        if not _loads(data).get("ok"):
            raise ConnectionRefusedError(f"the LLM manager at {self.address} refused the connection")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def reset(self) -> None:
        """Drop this thread's connection (after a failure, answers may be stale)."""
        cache = getattr(_LOCAL, "conns", {})
        state = cache.pop((os.getpid(), tuple(self.address), self.authkey), None)
        if state is not None:
            state["sock"].close()

    def open_streams(self, n: int) -> None:
        _send_frame(self._state()["sock"], {"op": "open", "n": n, "rollout": self.rollout})

    def close_stream(self) -> None:
        _send_frame(self._state()["sock"], {"op": "close", "n": 1})

    def submit(self, requests: list[GenerationRequest], sampling: SamplingParams) -> int:
        state = self._state()
        state["ticket"] += 1
        ticket = state["ticket"]
        _send_frame(state["sock"], {"op": "gen", "ticket": ticket,
                                    "requests": [r.to_dict() for r in requests],
                                    "sampling": sampling.to_dict()})
        state["outstanding"].add(ticket)
        return ticket

    def ready(self) -> bool:
        state = self._state()
        if state["inbox"]:
            return True
        return bool(select.select([state["sock"]], [], [], 0)[0])

    def wait_any(self) -> tuple[int, list[Completion]]:
        state = self._state()
        sock, inbox = state["sock"], state["inbox"]
        sock.settimeout(self.timeout_s)
        try:
            while True:
                while not inbox:
                    try:
                        data, _ = _recv_frame(sock, 1 << 31)
                    except socket.timeout:
                        self.reset()
                        raise TimeoutError(f"no answer from the LLM manager within {self.timeout_s} s") from None
                    inbox.extend(_loads(data)["answers"])
                msg = inbox.popleft()
                ticket = msg.get("ticket")
                if ticket not in state["outstanding"]:
                    continue  # an answer to a request abandoned after a failure
                state["outstanding"].discard(ticket)
                if "error" in msg:
                    raise EngineError(msg["error"])
                return ticket, [Completion.from_dict(c) for c in msg["completions"]]
        finally:
            if not sock._closed:  # type: ignore[attr-defined]
                sock.settimeout(None)

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        """Submit and wait: a blocking call for callers with one request list."""
        ticket = self.submit(requests, sampling)
        while True:
            got, completions = self.wait_any()
            if got == ticket:
                return completions
