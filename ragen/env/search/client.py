"""Searches over HTTP, on connections pooled per process: the search env's side of the retrieval server's API.

``retrieve(url, query, top_k, timeout_s, key_env)`` posts to ``<url>/retrieve``
with the key of the environment variable ``key_env`` (``ragen.env.keys``) and
returns the results; a server that is down, slow, refuses the key, or answers
anything but results raises ``RetrievalError`` naming it: ``RetrievalTimeout``
when the whole answer has not come within ``timeout_s`` (each read of the
connection's socket waits only for what is left of it, so a server that
trickles cannot stretch it), and an answer over ``MAX_ANSWER_BYTES`` is
refused unread. Connections are kept alive and shared by every env of the
process (urllib3's pool, thread-safe), so a search costs one round trip. A
forked process (the ``multiprocessing`` backend) makes a pool of its own: two
processes reading one kept-alive connection would take each other's answers.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

from ...errors import RagenError
from ..keys import RETRIEVAL_KEY_ENV, auth_headers, key_hint

__all__ = ["MAX_ANSWER_BYTES", "RetrievalError", "RetrievalTimeout", "health", "retrieve"]

logger = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 16 * 1024 * 1024  # 50 documents of 300k characters: far past any top_k a search env shows
_CHUNK = 64 * 1024
_DEADLINE = threading.local()  # .at: when this thread's search must have its answer (None: no search)

_POOL: Any = None
_POOL_PID = 0  # the process that made _POOL
_POOL_LOCK = threading.Lock()


class RetrievalError(RagenError, RuntimeError):
    """A search that failed; the message names the server."""


class RetrievalTimeout(RetrievalError, TimeoutError):
    """A retrieval server that did not answer in time."""


class _DeadlineSocket(socket.socket):
    """A connection's socket whose reads wait at most until the deadline of the search on this thread
    (a connection is used by one thread at a time: the pool lends it out)."""

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        at = getattr(_DEADLINE, "at", None)
        if at is not None:
            left = at - time.monotonic()
            if left <= 0:
                raise TimeoutError("the search's time is up")
            self.settimeout(left)
        return super().recv_into(buffer, nbytes, flags)


def _pool() -> Any:
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():  # a forked process's inherited connections are its parent's
            import urllib3

            class Connection(urllib3.connection.HTTPConnection):
                def connect(self) -> None:
                    super().connect()
                    timeout = self.sock.gettimeout()
                    self.sock = _DeadlineSocket(self.sock.family, self.sock.type, self.sock.proto,
                                                fileno=self.sock.detach())
                    self.sock.settimeout(timeout)  # a socket made from a descriptor starts blocking

            class Pool(urllib3.HTTPConnectionPool):
                ConnectionCls = Connection

            # maxsize: connections kept per server, as many as a worker's env threads may search at once
            _POOL = urllib3.PoolManager(num_pools=16, maxsize=64, retries=False)
            _POOL.pool_classes_by_scheme = {**_POOL.pool_classes_by_scheme, "http": Pool}
            _POOL_PID = os.getpid()
        return _POOL


def _read_bounded(response: Any, url: str) -> bytes:
    """The body, at most ``MAX_ANSWER_BYTES`` (more: ``RetrievalError``, the connection closed, not reused)."""
    too_big = RetrievalError(f"retrieval server {url}: the answer is over MAX_ANSWER_BYTES={MAX_ANSWER_BYTES} "
                             "bytes (ragen.env.search.client)")
    length = response.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > MAX_ANSWER_BYTES:
        raise too_big
    chunks, size = [], 0
    while chunk := response.read1(_CHUNK):
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> tuple[int, bytes]:
    """``/retrieve``'s status and body, the whole of it within ``timeout_s``."""
    import urllib3

    _DEADLINE.at = time.monotonic() + timeout_s
    response = None
    try:
        response = _pool().request("POST", f"{url}/retrieve", body=body, headers=headers, preload_content=False,
                                   timeout=urllib3.Timeout(connect=min(timeout_s, 10.0), read=timeout_s))
        return response.status, _read_bounded(response, url)
    except BaseException:
        if response is not None:
            response.close()  # unread bytes may be left on it: the pool makes a fresh connection
        raise
    finally:
        _DEADLINE.at = None
        if response is not None:
            response.release_conn()


def retrieve(url: str, query: str, top_k: int, timeout_s: float,
             key_env: str = RETRIEVAL_KEY_ENV) -> list[dict[str, Any]]:
    """The server's results for ``query``: ``[{"id", "content", "score"}, ...]``."""
    import urllib3

    body = json.dumps({"query": query, "top_k": top_k}).encode()
    headers = {"Content-Type": "application/json", **auth_headers(key_env)}
    try:
        status, data = _post(url, body, headers, timeout_s)
    except urllib3.exceptions.NewConnectionError as exc:  # refused: urllib3 makes it a kind of timeout
        raise RetrievalError(f"retrieval server {url}: cannot connect: {exc}") from exc
    except (urllib3.exceptions.TimeoutError, TimeoutError) as exc:
        raise RetrievalTimeout(f"retrieval server {url}: no whole answer within "
                               f"env_config.timeout_s={timeout_s} s") from exc
    except urllib3.exceptions.HTTPError as exc:  # refused, reset, unreachable
        raise RetrievalError(f"retrieval server {url}: {type(exc).__name__}: {exc}") from exc
    try:
        payload = json.loads(data)
    except ValueError:
        payload = None
    if status != 200:
        error = payload.get("error") if isinstance(payload, dict) else data[:200]
        hint = f"; {key_hint(key_env)}" if status == 401 else ""
        raise RetrievalError(f"retrieval server {url}: HTTP {status}: {error}{hint}")
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, list) or not all(isinstance(r, dict) and isinstance(r.get("content"), str)
                                                for r in results):
        raise RetrievalError(f"retrieval server {url}: the answer has no list of results with 'content': "
                             f"{data[:200]!r}")
    return results


def health(url: str, timeout_s: float = 2.0) -> str | None:
    """None when ``<url>/health`` answers 200; else why not."""
    import urllib3

    try:
        response = _pool().request("GET", f"{url}/health", timeout=urllib3.Timeout(total=timeout_s))
    except urllib3.exceptions.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if response.status == 200 else f"HTTP {response.status}"
