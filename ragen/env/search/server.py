"""A retrieval server: BM25 (``bm25s``) over a corpus, behind the HTTP API RAGEN's ``RetrievalClient`` calls.

- ``GET /health`` -> ``{"status": "healthy", "corpus_size": N, "index_type": "bm25"}``
- ``POST /retrieve`` with ``{"query": str, "top_k": int}`` (``k`` too; default 10,
  at most ``MAX_TOP_K``) -> ``{"query", "method": "bm25", "results": [{"id",
  "content", "score"}], "num_results"}``; a bad request -> 400 ``{"error": ...}``.

A search needs the server's key (``Authorization: Bearer <key>``, or Basic
with the key for password; HTTP 401 otherwise), on loopback too
(``ragen.env.keys``); ``/health`` needs none. Requests are bounded
(``MAX_BODY_BYTES``, ``MAX_QUERY_CHARS``), and so are connections: a
request is read within ``READ_DEADLINE_S`` of its first byte, an idle kept-alive
connection is closed after ``IDLE_S``, and past ``max_connections`` open at
once a new one gets HTTP 503 and is closed. Each connection is served on its
own thread (``ThreadingHTTPServer``), with ``TCP_NODELAY`` (an answer's headers
and body are two writes: Nagle's algorithm would hold the second for the
client's delayed ACK); the index is read-only.
The command line is ``python -m ragen.tools.retrieval_server``.
"""

from __future__ import annotations

import io
import json
import logging
import resource
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

from ..background import BackgroundServer
from ..keys import authorized, new_key
from .corpus import Doc

__all__ = ["MAX_TOP_K", "RetrievalServer"]

logger = logging.getLogger(__name__)

MAX_TOP_K = 50
MAX_BODY_BYTES = 64 * 1024
MAX_QUERY_CHARS = 2000
READ_DEADLINE_S = 10.0  # from a request's first byte to its last: a client that trickles is cut off
IDLE_S = 60.0  # a kept-alive connection with no request started
MAX_CONNECTIONS = 256


def default_max_connections() -> int:
    """``MAX_CONNECTIONS``, or half the descriptors this process may open where that is fewer (past the limit
    ``accept`` fails, and the listening socket would spin on it instead of refusing)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(1, min(MAX_CONNECTIONS, soft // 2))


class _DeadlineReader(io.RawIOBase):
    """A connection's reads: the first byte of a request within ``IDLE_S``, the rest of it by a deadline
    ``READ_DEADLINE_S`` after that byte (``TimeoutError`` past either; ``http.server`` then closes the
    connection). ``request_read`` starts the wait for the next request."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._deadline: float | None = None

    def readable(self) -> bool:
        return True

    def request_read(self) -> None:
        self._deadline = None

    def readinto(self, buffer: Any) -> int:
        if self._deadline is None:
            self._sock.settimeout(IDLE_S)
        else:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"a request not read within {READ_DEADLINE_S} s")
            self._sock.settimeout(left)
        n = self._sock.recv_into(buffer)
        if self._deadline is None:
            self._deadline = time.monotonic() + READ_DEADLINE_S
        return n


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once: past them a connection is answered
    503 and closed on the accepting thread (with no wait: the answer fits a fresh socket's buffer)."""

    daemon_threads = True
    _BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
             b"Content-Length: %d\r\n\r\n%s")

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int) -> None:
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if self._slots.acquire(blocking=False):
            super().process_request(request, client_address)
            return
        self.refused += 1
        body = json.dumps({"error": f"this retrieval server serves at most {self.max_connections} connections "
                                   "at once; try again later"}).encode()
        try:
            request.setblocking(False)
            try:
                request.recv(65536)  # what the client sent already: closing on unread bytes resets the connection
            except BlockingIOError:
                pass
            request.send(self._BUSY % (len(body), body))
        except OSError:  # gone, or a full buffer: it is closed all the same
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Index:
    """BM25 over the documents (English stop words left out)."""

    def __init__(self, docs: Sequence[Doc]) -> None:
        import bm25s

        self.docs = list(docs)
        self._bm25s = bm25s
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize([d.contents for d in self.docs], stopwords="en", show_progress=False),
                             show_progress=False)

    def search(self, query: str, k: int) -> list[dict[str, Any]]:
        tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.vocab:  # only stop words: nothing to rank by
            return []
        k = min(k, len(self.docs))
        found, scores = self.retriever.retrieve(tokens, k=k, show_progress=False)
        return [{"id": self.docs[i].id, "content": self.docs[i].contents, "score": float(s)}
                for i, s in zip(found[0], scores[0]) if s > 0]


class RetrievalServer(BackgroundServer):
    """Serves ``docs`` on ``host``:``port`` (0: a free port) to clients that hold ``key`` (None: a new
    one, ``self.key``)."""

    thread_name = "ragen-retrieval"

    def __init__(self, docs: Sequence[Doc], host: str = "127.0.0.1", port: int = 0, key: str | None = None,
                 max_connections: int | None = None) -> None:
        self.key = key or new_key()
        self.index = _Index(docs)
        self.requests = 0
        self._httpd = _BoundedHTTPServer((host, port), self._handler(), max_connections or default_max_connections())
        self.host, self.port = self._httpd.server_address[:2]

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def _stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _answer(self, body: bytes) -> tuple[int, dict[str, Any]]:
        try:
            request = json.loads(body)
        except ValueError as exc:
            return HTTPStatus.BAD_REQUEST, {"error": f"the body is not JSON: {exc}"}
        if not isinstance(request, dict) or not isinstance(request.get("query"), str):
            return HTTPStatus.BAD_REQUEST, {"error": "Missing 'query' in request"}
        query = request["query"]
        k = request.get("top_k", request.get("k", 10))
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_TOP_K:
            return HTTPStatus.BAD_REQUEST, {"error": f"top_k must be an integer from 1 to {MAX_TOP_K}, got {k!r}"}
        if len(query) > MAX_QUERY_CHARS:
            return HTTPStatus.BAD_REQUEST, {"error": f"the query is longer than {MAX_QUERY_CHARS} characters"}
        self.requests += 1
        results = self.index.search(query, k)
        return HTTPStatus.OK, {"query": query, "method": "bm25", "results": results, "num_results": len(results)}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: clients pool their connections

            disable_nagle_algorithm = True  # TCP_NODELAY, set in setup

            def setup(self) -> None:
                super().setup()
                self.rfile.close()  # the socket's own reader, for one that keeps the deadlines
                self._reader = _DeadlineReader(self.connection)
                self.rfile = io.BufferedReader(self._reader)

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                self._reader.request_read()  # read (or given up on): the connection waits for the next request
                self.connection.settimeout(READ_DEADLINE_S)  # a client that does not read its answer is cut off
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if self.close_connection:  # the client must not send its next request on this connection
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] != "/health":
                    self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint {self.path!r}"})
                    return
                self._send(HTTPStatus.OK, {"status": "healthy", "corpus_size": len(server.index.docs),
                                           "index_type": "bm25", "index_loaded": True})

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] != "/retrieve":
                    self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint {self.path!r}"})
                    return
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    length = -1
                if not 0 <= length <= MAX_BODY_BYTES:
                    self.close_connection = True
                    self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               {"error": f"a request body is at most {MAX_BODY_BYTES} bytes"})
                    return
                body = self.rfile.read(length)  # read first, refused or not: the connection stays in step
                if not authorized(self.headers.get("Authorization"), server.key):
                    self._send(HTTPStatus.UNAUTHORIZED, {"error": "this retrieval server needs its key: "
                                                                  "Authorization: Bearer <key>"})
                    return
                self._send(*server._answer(body))

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("%s " + fmt, self.address_string(), *args)

        return Handler
