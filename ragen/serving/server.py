"""SharedLLMInferenceManager: the one engine in the driver, served to every worker.

The manager owns the engine (the one the trainer updates) and a lock around
every engine call (``engine_lock``; the trainer takes it to swap weights). It
listens on a socket (loopback unless told otherwise), authenticates each
connection (``wire``), and runs one batcher thread that turns the requests of
all workers into engine calls as the ``Coalescer`` decides. At most
``max_pending_handshakes`` peers are in their handshake at once (a new one
closes the oldest, so idle peers never hold a worker out); a manager
listening beyond loopback warns that its port must be firewalled. A malformed
message gets an error reply and the connection goes on; an oversized frame or
a failed handshake closes that connection only; an engine that fails, or
answers with something other than one plain-data ``Completion`` per request,
gets its batch (or only the request lists it answered badly) answered with
errors, and the batcher goes on serving.

Announcements: the driver ``announce``s how many streams the work it
dispatched will open, under a tag that the workers' clients carry; the
coalescer waits for those streams before they open. What else the work
needs on the same connection, the announcer brings as ``Hooks``: handlers
of calls (``SharedLLMClient.call``; a call may open streams under the tag),
handlers of the counts workers attach to their messages
(``SharedLLMClient.note``), and an ``Observer`` told of every engine call and
of the requests it answers for the tag's streams. Observers and note
handlers run outside the manager's lock (answers are told just before they
are sent, so a worker cannot end its work before its answers are counted);
their errors are logged and ignored. The manager decides nothing from them.
"""

from __future__ import annotations

import ipaddress
import logging
import pickle
import secrets
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from ragen.llm.types import Completion, Engine, GenerationRequest, SamplingParams
from ragen.serving import wire
from ragen.serving.client import SharedLLMClient
from ragen.serving.coalescer import Coalescer, Pending

logger = logging.getLogger(__name__)


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
    _check_bindable(host)
    return host, port


def _check_bindable(host: str) -> None:
    """ValueError naming ``llm_server.host`` unless the manager can listen on
    it: an IPv4 address (or a name for one) of this machine. Tried on a free
    port, so that a wrong host is found before a model loads, not when the
    manager binds after it."""
    try:
        infos = socket.getaddrinfo(host, 0, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        ipv6 = ":" in host
        why = ("the manager listens on IPv4 only: use 127.0.0.1 for workers on this machine, 0.0.0.0 for "
               "workers on other machines" if ipv6 else f"it does not resolve to an IPv4 address ({exc.strerror})")
        raise ValueError(f"llm_server.host={host!r} cannot be listened on: {why}") from None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((infos[0][4][0], 0))
    except OSError as exc:
        raise ValueError(f"llm_server.host={host!r} cannot be listened on: {exc.strerror or exc} (an address of "
                         "this machine, 127.0.0.1 or 0.0.0.0)") from None


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
    alive: bool = True
    tag: int | None = None  # the tag its streams were last opened under (whose hooks its notes and answers reach)

    def send(self, obj: Any) -> int:
        return self.send_frame(wire.frame(obj))

    def send_frame(self, data: bytes) -> int:
        with self.send_lock:
            self.sock.sendall(data)
        return len(data)


@dataclass
class ManagerStats:
    """What the manager did, written by its threads (batcher, connections).
    Metrics code reads while they write: ``batch_sizes`` and ``call_spans``
    are copies taken under the lock (a deque cannot be iterated while the
    batcher appends to it), and ``snapshot()`` is one consistent copy of
    everything."""

    engine_calls: int = 0
    requests: int = 0
    engine_time_s: float = 0.0
    coalesce_wait_s: float = 0.0  # the engine free and requests queued, held for more (summed over calls)
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


class SharedLLMInferenceManager:
    """The driver's engine, served to every worker over authenticated
    connections, with the requests of all of them coalesced into engine calls."""

    def __init__(
        self,
        engine: Engine,
        max_batch_size: int = 256,
        coalesce_wait_s: float = 0.0005,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = 64 << 20,
        handshake_timeout_s: float = 5.0,
        max_coalesce_wait_s: float = 1.0,
        max_pending_handshakes: int = 64,
    ) -> None:
        self.coalescer = Coalescer(max_batch_size, coalesce_wait_s, max_coalesce_wait_s)
        check_listen_address(host, port)
        if max_pending_handshakes < 1:
            raise ValueError(f"max_pending_handshakes must be >= 1, got {max_pending_handshakes}")
        self.engine = engine
        self.engine_lock = threading.Lock()
        self.max_batch_size = self.coalescer.max_batch_size
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or \
                not 0 < max_message_bytes < 1 << 32:
            raise ValueError(f"agent_proxy.max_message_bytes must be an integer from 1 to 2**32 - 1 (a frame's "
                             f"length is 4 bytes), got {max_message_bytes!r}")
        self.max_message_bytes = max_message_bytes
        self.handshake_timeout_s = handshake_timeout_s
        # A thread per connection is fine for workers, not for any number of
        # peers that connect and say nothing. Every peer is accepted at once (a
        # worker never waits behind idle peers in the listen queue), and at
        # most this many are in their handshake: a new one closes the oldest,
        # so sockets and threads stay bounded (_accept_loop, _evict).
        self.max_pending_handshakes = max_pending_handshakes
        self._pending: OrderedDict[_Conn, None] = OrderedDict()  # oldest first
        self._pending_lock = threading.Lock()
        self._evicted = 0  # connections closed in their handshake to make room (accept thread only)
        self.stats = ManagerStats()
        self._key = secrets.token_bytes(32)
        self._cond = threading.Condition()  # guards the coalescer and _conns
        self._conns: set[_Conn] = set()
        self._closed = False
        # by announced tag; written under _cond, so a call's handler and withdraw never interleave
        self._hooks_lock = threading.Lock()
        self._hooks: dict[int, Hooks] = {}
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

    def client(self, timeout_s: float | None = None) -> SharedLLMClient:
        return SharedLLMClient(address=self.address, authkey=self._key, timeout_s=timeout_s,
                               max_message_bytes=self.max_message_bytes)

    def announce(self, n_streams: int, hooks: Hooks | None = None) -> int:
        """The driver dispatched work whose workers will open ``n_streams``
        streams: the coalescer waits for them (within its budget) before they
        connect, so a worker that starts late is not left out of the first
        call. ``hooks``: the calls, notes and observer of that work. Returns
        its tag, for ``SharedLLMClient.tag`` and ``withdraw``."""
        with self._cond:
            tag = self.coalescer.announce(n_streams)
            if hooks is not None:
                with self._hooks_lock:
                    self._hooks[tag] = hooks
            return tag

    def withdraw(self, tag: int) -> None:
        """The work of ``tag`` ended (or failed): expect none of its streams,
        and drop its hooks (a later call under it is answered None). Streams
        still open under it are work the driver gave up on (past its timeout,
        in a thread or a Dask task that cannot be stopped): waiting for them
        would hold every later engine call to its full wait budget. Their
        connection may still send requests; they are answered as usual."""
        with self._cond:
            self.coalescer.withdraw(tag)
            with self._hooks_lock:
                self._hooks.pop(tag, None)
            self._cond.notify_all()

    @property
    def hooked(self) -> tuple[int, ...]:
        """The tags whose hooks are in place (announced and not withdrawn)."""
        with self._hooks_lock:
            return tuple(self._hooks)

    def _observe(self, answered: dict[int | None, int], engine_call: int | None = None) -> None:
        """The observers: the size of the engine call starting, and the
        requests answered by tag."""
        with self._hooks_lock:
            observers = [(tag, h.observer) for tag, h in self._hooks.items() if h.observer is not None]
        for tag, observer in observers:
            try:
                if engine_call is not None:
                    observer.engine_call(engine_call)
                n = answered.get(tag, 0)
                if n:
                    observer.answered(n)
            except Exception:  # an observer never fails the manager
                logger.debug("the observer of tag %s failed", tag, exc_info=True)

    def _take_notes(self, conn: _Conn, notes: dict[str, int]) -> None:
        """The counts a message carried, to the note handlers of its connection's tag."""
        with self._hooks_lock:
            hooks = self._hooks.get(conn.tag) if conn.tag is not None else None
        if hooks is None:
            return
        for name, n in notes.items():
            handler = hooks.notes.get(name)
            if handler is None or not n:
                continue
            try:
                handler(n)
            except Exception:  # a note handler never fails the manager
                logger.debug("the handler of note %r of tag %s failed", name, conn.tag, exc_info=True)

    def _call(self, conn: _Conn, msg: wire.CallMessage) -> dict[str, Any]:
        """The reply to a call, from the handler of its kind under its tag (a
        withdrawn tag's: None); the streams it opens are open before the reply
        is sent."""
        with self._cond:
            with self._hooks_lock:
                hooks = self._hooks.get(msg.tag) if msg.tag is not None else None
            if hooks is None:
                return {"reply": None}
            handler = hooks.calls.get(msg.kind)
            if handler is None:
                return {"reply": None, "error": f"no handler of calls of kind {msg.kind!r} under tag {msg.tag}"}
            try:
                reply = handler(msg.payload)
            except Exception as exc:
                logger.exception("the handler of call %r of tag %s failed", msg.kind, msg.tag)
                return {"reply": None, "error": f"{type(exc).__name__}: {exc}"}
            if reply.streams:  # from now on streams of their own
                conn.tag = msg.tag
                self.coalescer.open(conn, reply.streams, msg.tag, time.monotonic())
                self._cond.notify_all()
            return {"reply": reply.payload}

    @property
    def open_streams(self) -> int:
        """Streams open over every connection (what the coalescer waits for)."""
        with self._cond:
            return self.coalescer.open_streams

    @property
    def announced(self) -> dict[int, int]:
        """Streams announced and not opened yet, by tag."""
        with self._cond:
            return dict(self.coalescer.announced)

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    # ----- connections ---------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                if self._closed:
                    return  # listener closed
                # EMFILE and the like: the peer waits in the listen queue; short, so close() is noticed
                logger.warning("could not accept a connection to the LLM manager", exc_info=True)
                time.sleep(0.05)
                continue
            conn = _Conn(sock, f"{peer[0]}:{peer[1]}")
            evicted = None
            with self._pending_lock:
                if len(self._pending) >= self.max_pending_handshakes:
                    evicted, _ = self._pending.popitem(last=False)
                self._pending[conn] = None
            if evicted is not None:
                self._evict(evicted)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._serve, args=(conn,), name="ragen-llm-conn", daemon=True).start()
            except (OSError, RuntimeError) as exc:  # the peer left already, or no thread to be had
                logger.warning("dropped a connection from %s: %s", conn.peer, exc)
                with self._pending_lock:
                    self._pending.pop(conn, None)
                sock.close()

    def _evict(self, conn: _Conn) -> None:
        """Ends the handshake of the oldest unauthenticated connection to make
        room for a new one: a worker proves the key within milliseconds, so
        only peers that hold a connection open without doing so are ever the
        oldest; its thread sees the socket shut and closes it."""
        self.stats.add(refused_clients=1)
        self._evicted += 1
        # a flood of idle peers would flood the log: the first, then every 1000th
        logger.log(logging.WARNING if self._evicted % 1000 == 1 else logging.DEBUG,
                   "closed the connection from %s: %d connections were in their handshake, the most there may be "
                   "(max_pending_handshakes), and the oldest gives way to a new one (%d closed so far)", conn.peer,
                   self.max_pending_handshakes, self._evicted)
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    @property
    def pending_handshakes(self) -> int:
        """Connections accepted that have not proven the key yet."""
        with self._pending_lock:
            return len(self._pending)

    def _serve(self, conn: _Conn) -> None:
        sock, peer = conn.sock, conn.peer
        try:
            try:
                wire.server_handshake(sock, self._key, self.handshake_timeout_s)
            except wire.AuthenticationError:
                self.stats.add(refused_clients=1)
                logger.warning("refused a client from %s: wrong key", peer)
                return
            except TimeoutError:
                self.stats.add(refused_clients=1)
                logger.warning("closed the connection from %s: no handshake within handshake_timeout_s=%s s",
                               peer, self.handshake_timeout_s)
                return
            finally:
                with self._pending_lock:
                    self._pending.pop(conn, None)
            with self._cond:
                self._conns.add(conn)
                self.coalescer.connect(conn)
            while not self._closed:
                data, n = wire.recv_frame(sock, self.max_message_bytes)
                self.stats.add(messages_in=1, bytes_in=n)
                self._handle(conn, data)
        except wire.ProtocolError as exc:
            self.stats.add(bad_messages=1)
            logger.warning("closing the connection from %s: %s", peer, exc)
        except (EOFError, OSError):
            pass  # the client went away (a worker that finished, died or timed out), or was evicted
        finally:
            with self._cond:
                conn.alive = False
                self._conns.discard(conn)
                self.coalescer.disconnect(conn)
                self._cond.notify_all()
            try:
                sock.close()
            except OSError:
                pass

    def _handle(self, conn: _Conn, data: bytes) -> None:
        try:
            msg = wire.parse_message(data)
        except wire.BadMessage as exc:
            self.stats.add(bad_messages=1)
            logger.warning("bad message from %s: %s", conn.peer, exc)
            conn.send({"answers": [{"ticket": exc.ticket, "error": f"bad message: {exc}"}]})
            return
        if msg.notes:
            self._take_notes(conn, msg.notes)
        if isinstance(msg, wire.CallMessage):
            reply = self._call(conn, msg)
            try:
                data = wire.frame({**reply, "sent": time.monotonic()})
            except pickle.PicklingError as exc:
                logger.error("the reply to call %r of tag %s is not plain data: %s", msg.kind, msg.tag, exc)
                data = wire.frame({"reply": None, "error": f"the reply is not plain data: {exc}"})
            self.stats.add(bytes_out=conn.send_frame(data))
            return
        if isinstance(msg, wire.StreamsMessage):
            with self._cond:
                if msg.op == "open":
                    conn.tag = msg.tag
                    self.coalescer.open(conn, msg.n, msg.tag, time.monotonic())
                else:
                    self.coalescer.close(conn, msg.n)
                self._cond.notify_all()
            return
        if not msg.requests:
            conn.send({"answers": [{"ticket": msg.ticket, "completions": []}]})
            return
        now = time.monotonic()
        pending = Pending(conn, msg.ticket, msg.requests, msg.sampling, now,
                          None if msg.sent is None else now - msg.sent)
        with self._cond:
            self.coalescer.arrive(pending)
            self._cond.notify_all()

    # ----- batching ------------------------------------------------------------
    def _next_batch(self) -> list[Pending] | None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                decision = self.coalescer.decide(now)
                if decision.batch is not None:
                    held = now - max(decision.batch[0].arrived, self.coalescer.engine_free_at)
                    self.stats.add(coalesce_wait_s=max(0.0, held))
                    return decision.batch
                # no bound needed: every change the decision depends on (a
                # request, a stream, a connection, close()) notifies
                self._cond.wait(None if decision.until is None else decision.until - time.monotonic())
            return None

    def _batch_loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                size = min(self.max_batch_size, sum(len(p.requests) for p in batch))
                self._observe({}, engine_call=size)  # the call about to run: shown while it runs
                answers = self._answers(batch)
                self._observe_answers(answers)  # before the reply: counted before a worker can end its work
                self._reply(answers)
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

    def _answers(self, batch: list[Pending]) -> dict[_Conn, list[dict[str, Any]]]:
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
                answer = {"ticket": p.ticket, "transit_in": p.transit_in,
                          "completions": [wire.completion_for_wire(c, r) for c, r in zip(part, p.requests)]}
            except Exception as exc:  # that request list only: the others' completions are good
                logger.error("malformed completion from the engine: %s", exc)
                answer = {"ticket": p.ticket, "error": f"{type(exc).__name__}: {exc}"}
            answers.setdefault(p.conn, []).append(answer)
        return answers

    def _observe_answers(self, answers: dict[_Conn, list[dict[str, Any]]]) -> None:
        """Tell the observers of one engine call the requests answered with
        completions, by the tag of their connection."""
        counts: dict[int | None, int] = {}
        for conn, conn_answers in answers.items():
            n = sum(len(a.get("completions", ())) for a in conn_answers)
            counts[conn.tag] = counts.get(conn.tag, 0) + n
        self._observe(counts)

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
            free_at = time.monotonic()
            with self._cond:
                self.coalescer.call_done(len(requests), elapsed, free_at)
            self.stats.record_call(sizes, (start, free_at), elapsed)
        return out

    def _reply(self, answers: dict[_Conn, list[dict[str, Any]]]) -> None:
        """One frame per connection, all encoded before any is sent: a woken
        worker takes a core at once, and the other workers' answers must not
        wait behind it."""
        frames = [(conn, self._fitting(wire.answers_frame(a), a), len(a)) for conn, a in answers.items()
                  if conn.alive]
        with self._cond:
            self.coalescer.answered({conn: n for conn, _, n in frames}, time.monotonic())
        for conn, data, _ in frames:
            try:
                self.stats.add(bytes_out=conn.send_frame(data))
            except OSError:
                pass  # the client left; its cleanup runs in its own thread

    def _fitting(self, data: bytes, answers: list[dict[str, Any]]) -> bytes:
        """``data``, or, when it is longer than a client reads (the client would
        drop the connection and its other answers with it), the same answers
        with the largest turned into errors until the rest fit."""
        size = len(data) - wire.HEADER_BYTES
        if size <= self.max_message_bytes:
            return data
        sizes = [len(wire.answers_frame([a])) for a in answers]
        answers = list(answers)
        for i in sorted(range(len(answers)), key=sizes.__getitem__, reverse=True):
            logger.error("the answer to ticket %s from %d bytes of answers exceeds max_message_bytes=%d; answering "
                         "it with an error", answers[i].get("ticket"), size, self.max_message_bytes)
            answers[i] = {"ticket": answers[i].get("ticket"), "error": (
                f"the engine's answer ({sizes[i]} bytes) does not fit the limit of {self.max_message_bytes} bytes "
                "of a message (agent_proxy.max_message_bytes)")}
            data = wire.answers_frame(answers)
            if len(data) - wire.HEADER_BYTES <= self.max_message_bytes:
                break
        return data

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
