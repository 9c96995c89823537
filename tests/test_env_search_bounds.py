"""The retrieval server and its client under hostile peers: a server no client can hold (a read deadline,
an idle limit, a connection cap answered 503), a client no server can hold (the whole answer's time and
size bounded), and a kept-alive search that does not wait on Nagle's algorithm."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ragen.env.search import client, server as server_module
from ragen.env.search.client import RetrievalError, RetrievalTimeout, retrieve
from ragen.env.search.corpus import shipped_corpus
from ragen.env.search.server import RetrievalServer

pytest.importorskip("bm25s", reason="the retrieval server's BM25: pip install -e '.[envs]' (bm25s==0.3.16)")

KEY = "the-key-of-the-bounds-server"


@pytest.fixture(autouse=True)
def client_key(monkeypatch):
    monkeypatch.setenv("RAGEN_RETRIEVAL_KEY", KEY)


def _closed_within(sock: socket.socket, seconds: float, trickle: bool) -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``seconds``), sending a byte
    of a promised body every 0.1 s where ``trickle``."""
    sock.settimeout(0.1)
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            if trickle:
                sock.send(b"x")
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:  # reset: closed too
            return time.monotonic() - start
    return None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("trickle", [True, False], ids=["one-byte-at-a-time", "idle"])
def test_the_server_closes_a_stalled_or_trickling_connection_within_its_deadline(monkeypatch, trickle):
    monkeypatch.setattr(server_module, "READ_DEADLINE_S", 0.5)
    monkeypatch.setattr(server_module, "IDLE_S", 0.5)
    with RetrievalServer(shipped_corpus(), key=KEY) as srv, \
            socket.create_connection((srv.host, srv.port)) as sock:
        if trickle:
            sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        took = _closed_within(sock, 5.0, trickle)
        assert took is not None and took < 2.5, f"the connection was still open after {took or 5.0} s"
        assert retrieve(srv.url, "town", 2, 5.0)  # the server serves on, with its key


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


@pytest.mark.timeout(30)
def test_past_its_connection_cap_the_server_answers_503_and_frees_the_slot_when_one_closes():
    with RetrievalServer(shipped_corpus(), key=KEY, max_connections=3) as srv:
        held = [socket.create_connection((srv.host, srv.port)) for _ in range(3)]
        time.sleep(0.3)  # accepted, each on its thread
        status, body = _health(srv.url)
        assert status == 503 and "at most 3 connections" in body["error"]
        held.pop().close()
        deadline = time.monotonic() + 5
        while _health(srv.url)[0] != 200:
            assert time.monotonic() < deadline, "a closed connection's slot was not freed"
            time.sleep(0.05)
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 5  # their threads free the slots as they see the closes
        while True:
            try:
                assert retrieve(srv.url, "town", 2, 5.0)  # keys still work on a capped server
                break
            except RetrievalError as exc:
                assert "at most 3 connections" in str(exc) and time.monotonic() < deadline, exc
                time.sleep(0.05)
    assert srv._httpd.refused >= 1


class _Peer(ThreadingHTTPServer):
    """A retrieval 'server' that answers with ``answer(handler)``."""

    daemon_threads = True

    def __init__(self, answer):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    answer(self)
                except OSError:  # the client hung up: what a bound does
                    pass

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


def _endless_body(handler):
    handler.send_response(200)
    handler.end_headers()  # no Content-Length: the body runs until the connection closes
    for _ in range(400):
        handler.wfile.write(b"0" * (256 * 1024))


def _huge_length(handler):
    handler.send_response(200)
    handler.send_header("Content-Length", str(400 * 1024 * 1024))
    handler.end_headers()
    for _ in range(400):
        handler.wfile.write(b"0" * (256 * 1024))


def _trickled_body(handler):
    handler.send_response(200)
    handler.send_header("Content-Length", "100")
    handler.end_headers()
    for _ in range(100):
        handler.wfile.write(b" ")
        handler.wfile.flush()
        time.sleep(0.1)


def _trickled_headers(handler):
    for byte in b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nX-Slow: " + b"y" * 100:
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()
        time.sleep(0.1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("answer", [_endless_body, _huge_length])
def test_the_client_refuses_an_answer_over_its_size_bound(monkeypatch, answer):
    monkeypatch.setattr(client, "MAX_ANSWER_BYTES", 1024 * 1024)
    with _Peer(answer) as peer:
        with pytest.raises(RetrievalError, match=rf"retrieval server {peer.url}: .*MAX_ANSWER_BYTES=1048576"):
            retrieve(peer.url, "q", 3, 10.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("answer", [_trickled_body, _trickled_headers])
def test_the_clients_timeout_bounds_the_whole_answer_not_each_read(answer):
    with _Peer(answer) as peer:
        start = time.monotonic()
        with pytest.raises(RetrievalTimeout, match=rf"retrieval server {peer.url}: .*timeout_s=0.5 s"):
            retrieve(peer.url, "q", 3, 0.5)
        assert time.monotonic() - start < 1.5


@pytest.mark.timeout(60)
def test_a_search_on_a_kept_alive_connection_does_not_wait_on_nagles_algorithm(monkeypatch):
    """The server's answer is two writes (headers, body); with Nagle's algorithm on, the second waits
    for the client's delayed ACK, about 40 ms on Linux (BENCHMARKS.md, the search preset): every
    connection the server serves has TCP_NODELAY."""
    seen = []
    finish = server_module._BoundedHTTPServer.finish_request

    def finish_and_look(self, request, client_address):
        finish(self, request, client_address)
        seen.append(request.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    monkeypatch.setattr(server_module._BoundedHTTPServer, "finish_request", finish_and_look)
    with RetrievalServer(shipped_corpus(), key=KEY) as srv:
        for _ in range(3):
            with urllib.request.urlopen(f"{srv.url}/health", timeout=10) as answer:  # one request a connection
                assert answer.status == 200
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert seen == [1, 1, 1]
