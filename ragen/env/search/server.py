"""A retrieval server: BM25 (``bm25s``) over a corpus, behind the HTTP API RAGEN's ``RetrievalClient`` calls.

- ``GET /health`` -> ``{"status": "healthy", "corpus_size": N, "index_type": "bm25"}``
- ``POST /retrieve`` with ``{"query": str, "top_k": int}`` (``k`` too; default 10,
  at most ``MAX_TOP_K``) -> ``{"query", "method": "bm25", "results": [{"id",
  "content", "score"}], "num_results"}``; a bad request -> 400 ``{"error": ...}``.

A search needs the server's key (``Authorization: Bearer <key>``, or Basic
with the key for password; HTTP 401 otherwise), on loopback too
(``ragen.env.keys``); ``/health`` needs none. Requests are bounded
(``MAX_BODY_BYTES``, ``MAX_QUERY_CHARS``). Each request is
served on its own thread (``ThreadingHTTPServer``); the index is read-only.
The command line is ``python -m ragen.tools.retrieval_server``.
"""

from __future__ import annotations

import json
import logging
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

    def __init__(self, docs: Sequence[Doc], host: str = "127.0.0.1", port: int = 0, key: str | None = None) -> None:
        self.key = key or new_key()
        self.index = _Index(docs)
        self.requests = 0
        self._httpd = ThreadingHTTPServer((host, port), self._handler())
        self._httpd.daemon_threads = True
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

            def _send(self, status: int, payload: dict[str, Any]) -> None:
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
