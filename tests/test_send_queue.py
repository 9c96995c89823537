"""``SendQueue``: a socket's sends never wait for the peer, reach it in order
once it reads, end with the stream's end after what is queued, and a peer
past the bound is dropped with a warning naming it. The manager's use is in
test_serving_send.py, the env server's in test_env_remote.py."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from ragen.send_queue import SendQueue

pytestmark = pytest.mark.timeout(30)


def _pair():
    """A connected socket pair whose reading side holds little, so that a few MiB wait in the queue."""
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    b.settimeout(10)
    return a, b


def _queue(sock, bound):
    return SendQueue(sock, "the peer", bound, server="test server", bound_name="the_bound", sender_name="test-send")


def _read_all(sock) -> bytes:
    chunks = []
    while chunk := sock.recv(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def test_the_end_of_the_stream_follows_what_is_queued():
    a, b = _pair()
    queue = _queue(a, 64 << 20)
    frames = [bytes([i]) * (1 << 20) for i in range(4)]  # far more than the socket pair holds
    for frame in frames:
        assert queue.send_frame(frame) == len(frame)  # at once: the peer reads nothing yet
    queue.shutdown_write()
    with pytest.raises(ConnectionError, match="closed"):
        queue.send_frame(b"late")
    got = [None]
    reader = threading.Thread(target=lambda: got.__setitem__(0, _read_all(b)))
    reader.start()
    reader.join(20)
    assert got[0] == b"".join(frames)  # every byte, in order, then the end
    queue.close()
    a.close(), b.close()


def test_a_peer_past_the_bound_is_dropped_naming_it(caplog):
    a, b = _pair()
    queue = _queue(a, 1 << 20)
    with caplog.at_level(logging.WARNING, logger="ragen.send_queue"):
        with pytest.raises(ConnectionError, match="the peer was dropped: it does not read"):
            for _ in range(64):
                queue.send_frame(b"x" * (256 << 10))
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("dropped the connection from the peer: it does not read what the test server sends")
    assert warning.endswith(f"and {256 << 10} more would pass the_bound={1 << 20}")
    assert len(_read_all(b)) < 64 * (256 << 10)  # what the kernel held, then the end: the socket is shut
    with pytest.raises(ConnectionError, match="closed"):
        queue.send_frame(b"x")
    queue.close()
    a.close(), b.close()
