"""SharedLLMInferenceManager: one engine in the driver, served to every worker.

- The manager owns the one engine (the one the trainer updates) and a lock
  around every engine call (``engine_lock``; the trainer takes it to swap
  weights). It listens on a socket (loopback unless told otherwise); each
  client proves it holds the manager's random per-run key (HMAC over a nonce)
  before anything else is read, and the manager proves it to the client in
  turn, so a worker never takes answers from a server that lacks the key. At
  most ``max_pending_handshakes`` peers are in their handshake at once; a
  manager listening beyond loopback warns that its port must be firewalled.
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
(dicts, lists, strings, bytes, numbers), written by a pickler and read by an
unpickler that refuse every class and function, so a frame can carry nothing
but data (as safe as JSON, and 5-8x cheaper to encode and decode: the full
message history of every env travels each turn). Each side refuses a frame
longer than its ``max_message_bytes``.

- Handshake, within ``handshake_timeout_s`` in all: manager -> client
  ``b"RAGEN2"`` and a 32-byte nonce; client -> manager
  ``HMAC-SHA256(key, b"ragen client" + that nonce)`` and a 32-byte nonce of its
  own; the manager checks the HMAC (a wrong one closes the connection), then
  sends the frame ``{"ok": True, "proof": HMAC-SHA256(key, b"ragen server" +
  the client's nonce)}``, which the client checks before it sends anything.
- Client -> manager: ``{"op": "open"|"close", "n": k}`` (streams), or
  ``{"op": "gen", "ticket": t, "requests": [...], "sampling": {...}}``.
- Manager -> client: ``{"answers": [...]}``, one frame per connection and
  engine call (a worker's streams answered together wake it once); each answer
  is ``{"ticket": t, "completions": [...]}`` (without token ids: they stay in
  the driver) or ``{"ticket": t, "error": msg}``.

A malformed message gets an error reply and the connection goes on (a request
whose fields have the wrong type or range is refused on arrival, alone, rather
than failing the engine call it would have joined); an oversized frame or a
failed handshake closes that connection only. An engine that fails, or answers
with something other than one plain-data ``Completion`` per request, gets its
batch (or, where only some completions are malformed, their request lists)
answered with errors; the batcher goes on serving.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import ipaddress
import json
import logging
import math
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

_MAGIC = b"RAGEN2"  # 2: the manager proves the key too
_NONCE_BYTES = 32
_DIGEST_BYTES = hashlib.sha256().digest_size
# Each side proves the key over its own label, so what one side answers can
# never be replayed as the other's proof.
_CLIENT_LABEL, _SERVER_LABEL = b"ragen client", b"ragen server"
_CONNECT_TIMEOUT_S = 30.0
_HEADER = struct.Struct(">I")


class EngineError(RuntimeError):
    """The shared engine failed on a request (raised in the client)."""


class ProtocolError(RuntimeError):
    pass


class AuthenticationError(ConnectionError):
    """The peer could not prove it holds the manager's key."""


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; with a ``deadline`` (time.monotonic()), TimeoutError once it
    passes, however the bytes trickle in (a timeout per recv would let one
    byte every few seconds hold a connection open for ever)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(buf)} of {n} bytes before the deadline")
            sock.settimeout(left)
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


class _DataPickler(pickle.Pickler):
    # Called only for objects that are not of a builtin type (str, int, dict,
    # list...): refusing them here costs nothing on plain data, and an engine's
    # numpy float or str subclass fails in the manager, where the request it
    # answers is known, not in the worker's unpickler.
    def reducer_override(self, obj: Any) -> Any:
        raise pickle.PicklingError(f"a frame may hold only plain data, not {type(obj).__module__}."
                                   f"{type(obj).__qualname__}")


def _frame(obj: Any) -> bytes:
    """A frame of plain data; pickle.PicklingError for anything else."""
    buf = io.BytesIO()
    buf.write(b"\0" * _HEADER.size)
    _DataPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    frame = buf.getbuffer()
    _HEADER.pack_into(frame, 0, len(frame) - _HEADER.size)
    del frame
    return buf.getvalue()


def _send_frame(sock: socket.socket, obj: Any) -> int:
    frame = _frame(obj)
    sock.sendall(frame)
    return len(frame)


def _recv_frame(sock: socket.socket, max_bytes: int, deadline: float | None = None) -> tuple[bytes, int]:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if n > max_bytes:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_bytes}")
    return _recv_exact(sock, n, deadline), n + _HEADER.size


def _wire(completion: Completion, request: GenerationRequest) -> dict[str, Any]:
    if not isinstance(completion, Completion):
        raise TypeError(f"the engine returned {type(completion).__name__}, not a Completion, for the request "
                        f"of env_id {request.env_id}, turn {request.turn}")
    # Workers read the text, finish reason and policy version, never the token
    # ids (the trainer tokenizes trajectories itself): keep them out of the
    # reply, where they would be most of its bytes and of its encoding time.
    d = completion.to_dict()
    d["prompt_token_ids"] = []
    d["response_token_ids"] = []
    return d


def _digest(key: bytes, label: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, label + nonce, hashlib.sha256).digest()


def _answers_frame(answers: list[dict[str, Any]]) -> bytes:
    """The frame of one connection's answers. An answer that is not plain
    data (an engine's numpy number, say) becomes an error for its request
    list alone: encoded apart, only on this rare path."""
    try:
        return _frame({"answers": answers})
    except pickle.PicklingError:
        pass
    checked = []
    for a in answers:
        try:
            _frame(a)
            checked.append(a)
            continue
        except pickle.PicklingError as exc:
            problem = exc
        for c in a.get("completions", []):
            try:
                _frame(c)
            except pickle.PicklingError as exc:
                problem = f"the completion for env_id {c.get('env_id')!r} (turn {c.get('turn')!r}): {exc}"
                break
        logger.error("malformed completion from the engine: %s", problem)
        checked.append({"ticket": a.get("ticket"), "error": f"the engine's answer cannot be sent: {problem}"})
    return _frame({"answers": checked})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# What each field of a request and of its sampling params must be. Checked
# when a request arrives: a wrong type found by the engine would fail the
# whole coalesced call, other workers' requests with it.
_REQUEST_FIELDS = {
    "env_id": (_is_int, "an integer"),
    "turn": (_is_int, "an integer"),
    "seed": (_is_int, "an integer"),
    # 0 is an answer of no tokens (every engine handles it): a turn with no room left
    "max_tokens": (lambda v: v is None or (_is_int(v) and v >= 0), "null or an integer >= 0"),
}
_SAMPLING_FIELDS = {
    "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and v >= -1, "an integer >= -1 (-1: no top-k)"),
    "max_tokens": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "seed": (_is_int, "an integer"),
    "stop": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
}


def _check_fields(values: dict[str, Any], checks: dict[str, Any], where: str) -> None:
    for name, (ok, what) in checks.items():
        if not ok(values[name]):
            raise ValueError(f"{where}.{name} must be {what}, got {repr(values[name])[:80]}")


def check_listen_address(host: Any, port: Any) -> tuple[str, int]:
    """``(host, port)`` for the manager to listen on (``llm_server.host``,
    ``llm_server.port``); ValueError naming the key otherwise. Read before any
    model loads, and again by the manager."""
    if not isinstance(host, str) or not host.strip() or host != host.strip():
        hint = " (an empty host listens on every interface without saying so)" if host == "" else ""
        raise ValueError(f"llm_server.host must be the address to listen on: 127.0.0.1 for workers on this "
                         f"machine, 0.0.0.0 for workers on other machines; got {host!r}{hint}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"llm_server.port must be an integer from 0 to 65535 (0: any free port), got {port!r}")
    return host, port


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


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
    """What the manager did, written by its threads (batcher, connections).
    Metrics code reads while they write: ``batch_sizes`` and ``call_spans``
    are copies taken under the lock (iterating the live deque while the
    batcher appended raised "deque mutated during iteration"), and
    ``snapshot()`` is one consistent copy of everything."""

    engine_calls: int = 0
    requests: int = 0
    engine_time_s: float = 0.0
    messages_in: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    refused_clients: int = 0
    bad_messages: int = 0
    _batch_sizes: deque = field(default_factory=lambda: deque(maxlen=8192), repr=False)  # the most recent calls'
    _call_spans: deque = field(default_factory=lambda: deque(maxlen=8192), repr=False)  # (start, end), monotonic
    _lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._batch_sizes)

    @property
    def call_spans(self) -> tuple[tuple[float, float], ...]:
        with self._lock:
            return tuple(self._call_spans)

    def add(self, **counts: int) -> None:
        """Add to counters (``+=`` from several threads loses updates)."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def record_call(self, batch_sizes: list[int], span: tuple[float, float], seconds: float) -> None:
        """One engine call of ``batch_sizes`` chunks."""
        with self._lock:
            self.engine_calls += len(batch_sizes)
            self._batch_sizes.extend(batch_sizes)
            self.requests += sum(batch_sizes)
            self.engine_time_s += seconds
            self._call_spans.append(span)

    def snapshot(self) -> "ManagerStats":
        with self._lock:
            return ManagerStats(**{**{k: v for k, v in self.__dict__.items() if k != "_lock"},
                                   "_batch_sizes": deque(self._batch_sizes, maxlen=8192),
                                   "_call_spans": deque(self._call_spans, maxlen=8192)})


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
        max_pending_handshakes: int = 64,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"agent_proxy.max_batch_size must be >= 1, got {max_batch_size}")
        if coalesce_wait_s < 0:
            raise ValueError(f"agent_proxy.coalesce_wait_s must be >= 0, got {coalesce_wait_s}")
        check_listen_address(host, port)
        self.engine = engine
        self.engine_lock = threading.Lock()
        self.max_batch_size = int(max_batch_size)
        self.coalesce_wait_s = float(coalesce_wait_s)
        self.max_coalesce_wait_s = float(max_coalesce_wait_s)
        self.call_cost = CallCostModel()
        self._engine_free_at = 0.0
        self.max_message_bytes = int(max_message_bytes)
        self.handshake_timeout_s = handshake_timeout_s
        if max_pending_handshakes < 1:
            raise ValueError(f"max_pending_handshakes must be >= 1, got {max_pending_handshakes}")
        # A thread per connection is fine for workers, not for any number of
        # peers that connect and say nothing: at most this many handshakes run
        # at once; further peers wait in the listen queue (a worker among them
        # only waits, it is not turned away).
        self._handshake_slots = threading.BoundedSemaphore(max_pending_handshakes)
        self.max_pending_handshakes = max_pending_handshakes
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
        if not _is_loopback(self.address[0]):
            # The key keeps strangers from being served, not from connecting,
            # holding handshake slots or reading the hello.
            logger.warning("the shared LLM manager listens on %s:%d, beyond this machine (llm_server.host): "
                           "firewall port %d so that only the machines of the rollout workers reach it",
                           self.address[0], self.address[1], self.address[1])

    def __repr__(self) -> str:  # never shows the key
        return f"SharedLLMInferenceManager(address={self.address}, engine={type(self.engine).__name__})"

    def client(self, timeout_s: float | None = None) -> "SharedLLMClient":
        return SharedLLMClient(address=self.address, authkey=self._key, timeout_s=timeout_s,
                               max_message_bytes=self.max_message_bytes)

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
        full = False
        while not self._closed:
            if not self._handshake_slots.acquire(timeout=0.2):  # short: close() is noticed
                if not full:
                    full = True
                    logger.warning("%d connections to the LLM manager are in their handshake at once; further "
                                   "ones wait until one ends (at most handshake_timeout_s=%s s each)",
                                   self.max_pending_handshakes, self.handshake_timeout_s)
                continue
            full = False
            try:
                sock, peer = self._listener.accept()
            except OSError:
                self._handshake_slots.release()
                return  # listener closed
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"),
                                 name="ragen-llm-conn", daemon=True).start()
            except (OSError, RuntimeError) as exc:  # the peer left already, or no thread to be had
                logger.warning("dropped a connection from %s:%s: %s", peer[0], peer[1], exc)
                sock.close()
                self._handshake_slots.release()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        conn = _Conn(sock, peer)
        slot = True  # one of the handshake slots, held until the handshake ends
        try:
            # One deadline for the whole handshake; nothing but the proof is
            # read before the key is known to be right.
            deadline = time.monotonic() + self.handshake_timeout_s
            sock.settimeout(self.handshake_timeout_s)
            nonce = secrets.token_bytes(_NONCE_BYTES)
            sock.sendall(_MAGIC + nonce)
            answer = _recv_exact(sock, _DIGEST_BYTES, deadline)
            if not hmac.compare_digest(answer, _digest(self._key, _CLIENT_LABEL, nonce)):
                self.stats.add(refused_clients=1)
                logger.warning("refused a client from %s: wrong key", peer)
                return
            client_nonce = _recv_exact(sock, _NONCE_BYTES, deadline)
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            conn.send({"ok": True, "proof": _digest(self._key, _SERVER_LABEL, client_nonce)})
            sock.settimeout(None)
            self._handshake_slots.release()
            slot = False
            with self._cond:
                self._conns.add(conn)
            while not self._closed:
                data, n = _recv_frame(sock, self.max_message_bytes)
                self.stats.add(messages_in=1, bytes_in=n)
                self._handle(conn, data)
        except ProtocolError as exc:
            self.stats.add(bad_messages=1)
            logger.warning("closing the connection from %s: %s", peer, exc)
        except TimeoutError:  # only the handshake has a timeout
            self.stats.add(refused_clients=1)
            logger.warning("closed the connection from %s: no handshake within handshake_timeout_s=%s s",
                           peer, self.handshake_timeout_s)
        except (EOFError, OSError):
            pass  # the client went away (a worker that finished, died or timed out)
        finally:
            if slot:
                self._handshake_slots.release()
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
            for i, r in enumerate(requests):
                if not isinstance(r.messages, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in r.messages
                ):
                    raise ValueError(f"requests[{i}].messages must be a list of {{role, content}} (strings)")
                _check_fields(r.to_dict(), _REQUEST_FIELDS, f"requests[{i}]")
            sampling_raw = msg.get("sampling") or {}
            if not isinstance(sampling_raw, dict):
                raise ValueError("'sampling' must be an object")
            sampling = SamplingParams.from_dict(sampling_raw)
            _check_fields(sampling.to_dict(), _SAMPLING_FIELDS, "sampling")
        except (ValueError, TypeError) as exc:
            self.stats.add(bad_messages=1)
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
            try:
                self._reply(self._answers(batch))
            except Exception as exc:  # a bug here must not end the thread: every later request would wait forever
                logger.exception("the batcher failed on %d requests; answering them with an error", len(batch))
                answers: dict[_Conn, list[dict[str, Any]]] = {}
                for p in batch:
                    answers.setdefault(p.conn, []).append(
                        {"ticket": p.ticket, "error": f"the LLM manager failed: {type(exc).__name__}: {exc}"})
                try:
                    self._reply(answers)
                except Exception:
                    logger.exception("could not answer %d requests", len(batch))

    def _answers(self, batch: list[_Pending]) -> dict[_Conn, list[dict[str, Any]]]:
        """One engine call for ``batch``: each request list's completions, or
        an error that says what was wrong with them."""
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
            return answers
        i = 0
        for p in batch:
            part = completions[i: i + len(p.requests)]
            i += len(p.requests)
            try:
                answer = {"ticket": p.ticket, "completions": [_wire(c, r) for c, r in zip(part, p.requests)]}
            except Exception as exc:  # that request list only: the others' completions are good
                logger.error("malformed completion from the engine: %s", exc)
                answer = {"ticket": p.ticket, "error": f"{type(exc).__name__}: {exc}"}
            answers.setdefault(p.conn, []).append(answer)
        return answers

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[Completion]:
        """One engine call (in chunks of ``max_batch_size``) under the engine lock."""
        out: list[Completion] = []
        with self.engine_lock:
            start = time.monotonic()
            t0 = time.perf_counter()
            sizes = []
            for i in range(0, len(requests), self.max_batch_size):
                chunk = requests[i: i + self.max_batch_size]
                got = self.engine.generate(chunk, sampling)
                if not isinstance(got, (list, tuple)):
                    raise TypeError(f"the engine returned {type(got).__name__}, not a list of completions")
                if len(got) != len(chunk):
                    raise RuntimeError(f"engine returned {len(got)} completions for {len(chunk)} requests")
                out += got
                sizes.append(len(chunk))
            elapsed = time.perf_counter() - t0
            self.call_cost.add(len(requests), elapsed)
            self._engine_free_at = time.monotonic()
            self.stats.record_call(sizes, (start, self._engine_free_at), elapsed)
        return out

    def _reply(self, answers: dict[_Conn, list[dict[str, Any]]]) -> None:
        """One frame per connection, all encoded before any is sent: a woken
        worker takes a core at once, and the other workers' answers must not
        wait behind it."""
        frames = [(conn, _answers_frame(a), len(a)) for conn, a in answers.items() if conn.alive]
        now = time.monotonic()
        with self._cond:
            for conn, _, n in frames:
                for _ in range(min(n, conn.streams - len(conn.idle))):
                    conn.idle.append((now, True))
        for conn, frame, _ in frames:
            try:
                self.stats.add(bytes_out=conn.send_frame(frame))
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
    max_message_bytes: int = 64 << 20  # the largest frame it reads, as the manager caps what it reads

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
        """A connection whose two ends proved they hold the key: the worker
        proves it over the manager's nonce, the manager over the worker's (a
        server that does not know the key must not feed workers answers)."""
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        sock = socket.create_connection(tuple(self.address), timeout=_CONNECT_TIMEOUT_S)
        try:
            hello = _recv_exact(sock, len(_MAGIC) + _NONCE_BYTES, deadline)
            if not hello.startswith(_MAGIC):
                raise ProtocolError(f"{self.address} is not a ragen LLM manager (of this version)")
            nonce = secrets.token_bytes(_NONCE_BYTES)
            sock.sendall(_digest(self.authkey, _CLIENT_LABEL, hello[len(_MAGIC):]) + nonce)
            try:
                data, _ = _recv_frame(sock, 1 << 10, deadline)
            except (EOFError, ConnectionResetError):  # reset: it closed before reading our nonce
                raise ConnectionRefusedError(f"the LLM manager at {self.address} refused the key") from None
            reply = _loads(data)
            if not isinstance(reply, dict) or not reply.get("ok"):
                raise ConnectionRefusedError(f"the LLM manager at {self.address} refused the connection")
            proof = reply.get("proof")
            if not isinstance(proof, bytes) or not hmac.compare_digest(
                    proof, _digest(self.authkey, _SERVER_LABEL, nonce)):
                raise AuthenticationError(
                    f"the server at {self.address} did not prove it holds the key of this client's LLM manager: "
                    "it is not that manager (a stale address, or another process on its port); refusing it")
        except TimeoutError:
            sock.close()
            raise TimeoutError(f"no handshake from the LLM manager at {self.address} within "
                               f"{_CONNECT_TIMEOUT_S} s") from None
        except BaseException:
            sock.close()
            raise
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
                        data, _ = _recv_frame(sock, self.max_message_bytes)
                        reply = _loads(data)
                        if not isinstance(reply, dict) or not isinstance(reply.get("answers"), list):
                            raise ValueError("a reply must be {'answers': [...]}")
                    except socket.timeout:
                        self.reset()
                        raise TimeoutError(f"no answer from the LLM manager within {self.timeout_s} s") from None
                    except ProtocolError as exc:  # not read: the stream is out of step, drop it
                        self.reset()
                        raise ProtocolError(f"a reply from the LLM manager at {self.address}: {exc} (the client's "
                                            "max_message_bytes, the manager's max_message_bytes for "
                                            "its clients)") from None
                    except ValueError as exc:
                        self.reset()
                        raise ProtocolError(f"bad reply from the LLM manager at {self.address}: {exc}") from None
                    inbox.extend(reply["answers"])
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
