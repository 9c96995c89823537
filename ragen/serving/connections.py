"""The manager's connections: each peer is accepted at once and authenticated
(``wire``) on a thread of its own; at most ``max_pending_handshakes`` peers
are in their handshake at once (a new one closes the oldest, so idle peers
never hold a worker out). The malformed messages of a frame get one error
reply and one warning, and the connection goes on; an oversized frame or a
failed handshake closes that connection only. Requests and streams go to the
coalescer, calls and notes to the hooks of their tag. What is sent to a peer
goes through that connection's own bounded queue (``Connection.send_frame``),
so a peer that stops reading delays only its own answers, and is dropped once
its queue is full."""

from __future__ import annotations

import logging
import pickle
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

from ragen.llm.types import Engine
from ragen.send_queue import SendQueue
from ragen.serving import messages, wire
from ragen.serving.coalescer import Coalescer, Pending
from ragen.serving.hooks import Hooks
from ragen.serving.stats import ManagerStats

logger = logging.getLogger(__name__)


class Connection(SendQueue):
    """One peer's connection: its socket, and its frames in the order they
    were sent, through a bounded queue of its own (``SendQueue``), so that
    the thread sending (the batcher, the streamer, the connection's) never
    waits for a peer that does not read. A peer whose queue would pass
    ``max_queued_bytes`` (``max_send_queue_bytes``) is dropped: its socket
    shut (its thread then cleans up) and a warning naming it."""

    def __init__(self, sock: socket.socket, peer: str, max_queued_bytes: int) -> None:
        super().__init__(sock, peer, max_queued_bytes, server="manager", bound_name="max_send_queue_bytes",
                         sender_name="ragen-llm-send")
        self.alive = True
        # the tag its streams were last opened under (whose hooks its notes and answers reach)
        self.tag: int | None = None

    def describe(self) -> str:
        return f"{self.peer} (tag {self.tag})"

    def send(self, obj: Any) -> int:
        return self.send_frame(wire.frame(obj))


class Connections:
    """The connection half of ``SharedLLMInferenceManager`` (its base class):
    the accept loop, the handshakes and the messages of each connection. The
    manager's ``__init__`` sets the state below and starts ``_accept_loop``."""

    engine: Engine  # its vocab_size, where known, bounds the history ids of a request
    coalescer: Coalescer
    stats: ManagerStats
    max_message_bytes: int
    max_send_queue_bytes: int
    handshake_timeout_s: float
    max_pending_handshakes: int
    _key: bytes
    _listener: socket.socket
    _pending: OrderedDict[Connection, None]  # in their handshake, oldest first
    _pending_lock: threading.Lock
    _evicted: int
    _cond: threading.Condition  # guards the coalescer and _conns
    _conns: set[Connection]
    _closed: bool
    _hooks_lock: threading.Lock
    _hooks: dict[int, Hooks]

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
            conn = Connection(sock, f"{peer[0]}:{peer[1]}", self.max_send_queue_bytes)
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

    def _evict(self, conn: Connection) -> None:
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

    def _serve(self, conn: Connection) -> None:
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
            conn.close()
            try:
                sock.close()
            except OSError:
                pass

    def _handle(self, conn: Connection, data: bytes) -> None:
        try:
            msg = messages.parse_message(data, self.engine.vocab_size)
        except messages.BadMessage as exc:
            self._bad(conn, [exc])
            return
        if isinstance(msg, messages.StreamsMessage) and msg.op == "open":
            conn.tag = msg.tag  # its notes are the tag's
        if msg.notes:
            self._take_notes(conn, msg.notes)
        if not isinstance(msg, messages.BatchMessage):
            self._answer_now(conn, [a for a in [self._dispatch(conn, msg)] if a is not None])
            return
        bad = [item for item in msg.items if isinstance(item, messages.BadMessage)]
        answers = [self._dispatch(conn, item) for item in msg.items if not isinstance(item, messages.BadMessage)]
        self._answer_now(conn, [a for a in answers if a is not None])
        if bad:
            self._bad(conn, bad)

    def _bad(self, conn: Connection, bad: list[messages.BadMessage]) -> None:
        """The bad messages of one frame: one warning, and one reply that answers each ticket."""
        self.stats.add(bad_messages=len(bad))
        if len(bad) == 1:
            logger.warning("bad message from %s: %s", conn.peer, bad[0])
        else:
            logger.warning("%d bad messages in a batch from %s; the first: %s", len(bad), conn.peer, bad[0])
        answers = [{"ticket": exc.ticket, "error": f"bad message: {exc}"} for exc in bad if exc.ticket is not None]
        if len(answers) < len(bad):  # the client reads the error of a message without a ticket only once
            answers.append({"ticket": None, "error": f"bad message: {next(e for e in bad if e.ticket is None)}"})
        self._answer_now(conn, answers)

    def _answer_now(self, conn: Connection, answers: list[dict[str, Any]]) -> None:
        """Answers that need no engine, in as few frames as the client reads (one, but for a
        batch of thousands of bad messages)."""
        if not answers:
            return
        data = messages.answers_frame(answers)
        if len(data) - wire.HEADER_BYTES > self.max_message_bytes and len(answers) > 1:
            half = len(answers) // 2
            self._answer_now(conn, answers[:half])
            self._answer_now(conn, answers[half:])
            return
        self.stats.add(bytes_out=conn.send_frame(data))

    def _dispatch(self, conn: Connection, msg: messages.StreamsMessage | messages.CallMessage | messages.GenMessage
                  | messages.CancelMessage) -> dict[str, Any] | None:
        """Serves one message; the answer to send at once, if it has one that needs no engine."""
        if isinstance(msg, messages.CallMessage):
            reply = self._call(conn, msg)
            try:
                data = wire.frame({**reply, "sent": time.monotonic()})
            except pickle.PicklingError as exc:
                logger.error("the reply to call %r of tag %s is not plain data: %s", msg.kind, msg.tag, exc)
                data = wire.frame({"reply": None, "error": f"the reply is not plain data: {exc}"})
            self.stats.add(bytes_out=conn.send_frame(data))
            return None
        if isinstance(msg, messages.CancelMessage):
            self._cancel(conn, msg.ticket)
            return None
        if isinstance(msg, messages.StreamsMessage):
            with self._cond:
                if msg.op == "open":
                    conn.tag = msg.tag
                    self.coalescer.open(conn, msg.n, msg.tag, time.monotonic(), msg.announced)
                else:
                    self.coalescer.close(conn, msg.n)
                self._cond.notify_all()
            return None
        if not msg.requests:
            return {"ticket": msg.ticket, "completions": []}
        now = time.monotonic()
        self._arrive(Pending(conn, msg.ticket, msg.requests, msg.sampling, now,
                             None if msg.sent is None else now - msg.sent))
        return None

    def _arrive(self, pending: Pending) -> None:
        """A request list for the engine (the manager's: coalesced, or streamed)."""
        raise NotImplementedError

    def _cancel(self, conn: Connection, ticket: int) -> None:
        """The worker stopped waiting for ``ticket`` (the manager's: a streaming engine drops it)."""
        raise NotImplementedError

    def _take_notes(self, conn: Connection, notes: dict[str, int]) -> None:
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

    def _call(self, conn: Connection, msg: messages.CallMessage) -> dict[str, Any]:
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
            except Exception as exc:  # the rollout's handler: its failure is the caller's error, not the manager's
                logger.exception("the handler of call %r of tag %s failed", msg.kind, msg.tag)
                return {"reply": None, "error": f"{type(exc).__name__}: {exc}"}
            if reply.streams:  # from now on streams of their own
                conn.tag = msg.tag
                self.coalescer.open(conn, reply.streams, msg.tag, time.monotonic())
                self._cond.notify_all()
            return {"reply": reply.payload}
