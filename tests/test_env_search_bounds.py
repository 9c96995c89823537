"""The retrieval server under hostile peers: a server no client can hold (a read deadline, an idle limit,
a connection cap answered 503), and a kept-alive search that does not wait on Nagle's algorithm."""

from __future__ import annotations

import json
import socket
import statistics
import time
import urllib.error
import urllib.request

import pytest

from ragen.env.search import server as server_module
from ragen.env.search.client import retrieve
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
        assert retrieve(srv.url, "town", 2, 5.0)  # keys still work on a capped server
    assert srv._httpd.refused >= 1


@pytest.mark.timeout(60)
def test_a_search_on_a_kept_alive_connection_does_not_wait_on_nagles_algorithm():
    """The server's answer is two writes (headers, body); with Nagle's algorithm on, the second waits
    for the client's delayed ACK, about 40 ms on Linux."""
    with RetrievalServer(shipped_corpus(), key=KEY) as srv:
        retrieve(srv.url, "town", 3, 5.0)  # the connection the rest reuse
        took = []
        for i in range(40):
            start = time.perf_counter()
            retrieve(srv.url, f"town {i}", 3, 5.0)
            took.append(time.perf_counter() - start)
        assert statistics.median(took) < 0.015, f"median {statistics.median(took) * 1e3:.1f} ms"
