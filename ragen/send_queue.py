"""A socket's sends through a bounded queue of its own (``SendQueue``), so that
the thread that sends never waits for a peer that does not read, and a peer
that stops reading is dropped once what waits for it passes a bound. The LLM
manager's connections (``ragen.serving.connections``) and the env server's
sessions (``ragen.env.remote.server``) send through one each."""

from __future__ import annotations

import logging
import socket
import threading
from collections import deque

__all__ = ["SendQueue"]

logger = logging.getLogger(__name__)

# a frame sent at once where the socket has room, without blocking (not on every platform)
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", None)
_SENDER_JOIN_S = 5.0  # its socket is shut first, so the sender's send ends at once


class SendQueue:
    """One socket's outgoing bytes, in the order they were sent. A frame goes
    out at once while the socket has room; the rest waits in a queue, sent by
    a thread of its own (named ``sender_name``) that exists only while the
    queue holds frames, so that the thread sending never waits for the peer.
    A peer whose queue would pass ``max_queued_bytes`` is dropped: its socket
    shut (which ends a send in progress; the socket's owner then sees it and
    closes it) and a warning naming ``peer``, what ``server`` it does not read
    and the bound, as the setting ``bound_name``."""

    def __init__(self, sock: socket.socket, peer: str, max_queued_bytes: int, *, server: str, bound_name: str,
                 sender_name: str) -> None:
        self.sock = sock
        self.peer = peer
        self.max_queued_bytes = max_queued_bytes
        self._server = server
        self._bound_name = bound_name
        self._sender_name = sender_name
        self._lock = threading.Lock()  # the queue, and the order of the frames on the socket
        self._queue: deque[memoryview] = deque()  # its head is the one being sent
        self._queued = 0  # bytes in the queue
        self._eof = False  # shut the socket for writing once the queue is sent
        self._sender: threading.Thread | None = None
        self._closed = False

    def describe(self) -> str:
        """The peer as the warning of its drop names it."""
        return self.peer

    def send_frame(self, data: bytes) -> int:
        """Sends ``data``, or queues what the socket has no room for; never
        waits for the peer. ConnectionError when the connection is closed, or
        is dropped because its queue would pass its bound."""
        with self._lock:
            if self._closed or self._eof:
                raise ConnectionError(f"the connection from {self.peer} is closed")
            queued = self._queued
            over = bool(self._queue) and queued + len(data) > self.max_queued_bytes
            if over:
                self._drop()
            elif self._queue:
                self._enqueue(memoryview(data))  # after the frames before it
            else:
                self._send_now(data)
        if over:
            logger.warning("dropped the connection from %s: it does not read what the %s sends; %d bytes wait for "
                           "it, and %d more would pass %s=%d", self.describe(), self._server, queued, len(data),
                           self._bound_name, self.max_queued_bytes)
            raise ConnectionError(f"the connection from {self.peer} was dropped: it does not read")
        return len(data)

    def shutdown_write(self) -> None:
        """The end of what is sent: the socket shut for writing once the frames queued before are sent."""
        with self._lock:
            if self._closed or self._eof:
                return
            self._eof = True
            if not self._queue:
                self._shut_write()

    def _send_now(self, data: bytes) -> None:
        """(under the lock, nothing queued) What the socket has room for now; the rest queued."""
        sent = 0
        if _DONTWAIT is not None:
            try:
                # with this flag the call does not block on a socket without a timeout (both owners' once
                # connected); one with a timeout (websockets' while it closes) waits for room up to it
                sent = self.sock.send(data, _DONTWAIT)
            except BlockingIOError:
                pass
            except OSError as exc:
                self._drop()
                raise ConnectionError(f"the connection from {self.peer} is closed: {exc}") from None
        if sent < len(data):
            self._enqueue(memoryview(data)[sent:])

    def _enqueue(self, data: memoryview) -> None:
        """(under the lock) ``data`` after the queued frames, and a sender for them."""
        self._queue.append(data)
        self._queued += len(data)
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_queued, name=self._sender_name, daemon=True)
            try:
                self._sender.start()
            except RuntimeError:  # no thread to be had: the peer cannot be answered
                self._sender = None
                self._drop()
                raise ConnectionError(f"no thread to send to {self.peer}") from None

    def _send_queued(self) -> None:
        """The sender: the queue's frames, oldest first; it ends when the queue is empty or the connection closed."""
        while True:
            with self._lock:
                if self._closed or not self._queue:
                    self._sender = None
                    return
                data = self._queue[0]
            try:
                # no bound needed: a peer that does not read has its queue pass the
                # bound (or its connection closed), and both shut the socket, which ends this send
                self.sock.sendall(data)
            except OSError:
                with self._lock:
                    self._drop()
                    self._sender = None
                return  # the peer left: the socket's owner sees it and cleans up
            with self._lock:
                if self._closed:
                    self._sender = None
                    return
                self._queue.popleft()
                self._queued -= len(data)
                if self._eof and not self._queue:
                    self._shut_write()

    def _shut_write(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:  # the socket is closed already
            pass

    def _drop(self) -> None:
        """(under the lock) No more frames: the queue emptied, the socket shut (which ends the sender's send)."""
        self._closed = True
        self._queue.clear()
        self._queued = 0
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Drops the connection and waits for its sender (bounded); the socket
        itself is closed by its owner."""
        with self._lock:
            self._drop()
            sender = self._sender
        if sender is not None and sender is not threading.current_thread():
            sender.join(timeout=_SENDER_JOIN_S)
