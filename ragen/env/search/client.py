"""Searches over HTTP, on connections pooled per process: the search env's side of the retrieval server's API.

``retrieve(url, query, top_k, timeout_s, key_env)`` posts to ``<url>/retrieve``
with the key of the environment variable ``key_env`` (``ragen.env.keys``) and
returns the results; a server that is down, slow, refuses the key, or answers
anything but results raises ``RetrievalError`` naming it (``RetrievalTimeout``
past the time limit). Connections are kept alive and shared by every env of the
process (urllib3's pool, thread-safe), so a search costs one round trip. A
forked process (the ``multiprocessing`` backend) makes a pool of its own: two
processes reading one kept-alive connection would take each other's answers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from ..keys import RETRIEVAL_KEY_ENV, auth_headers, key_hint

__all__ = ["RetrievalError", "RetrievalTimeout", "health", "retrieve"]

logger = logging.getLogger(__name__)

_POOL: Any = None
_POOL_PID = 0  # the process that made _POOL
_POOL_LOCK = threading.Lock()


class RetrievalError(RuntimeError):
    """A search that failed; the message names the server."""


class RetrievalTimeout(RetrievalError, TimeoutError):
    """A retrieval server that did not answer in time."""


def _pool() -> Any:
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():  # a forked process's inherited connections are its parent's
            import urllib3

            # maxsize: connections kept per server, as many as a worker's env threads may search at once
            _POOL = urllib3.PoolManager(num_pools=16, maxsize=64, retries=False)
            _POOL_PID = os.getpid()
        return _POOL


def retrieve(url: str, query: str, top_k: int, timeout_s: float,
             key_env: str = RETRIEVAL_KEY_ENV) -> list[dict[str, Any]]:
    """The server's results for ``query``: ``[{"id", "content", "score"}, ...]``."""
    import urllib3

    body = json.dumps({"query": query, "top_k": top_k}).encode()
    headers = {"Content-Type": "application/json", **auth_headers(key_env)}
    try:
        response = _pool().request("POST", f"{url}/retrieve", body=body, headers=headers,
                                   timeout=urllib3.Timeout(connect=min(timeout_s, 10.0), read=timeout_s))
    except urllib3.exceptions.NewConnectionError as exc:  # refused: urllib3 makes it a kind of timeout
        raise RetrievalError(f"retrieval server {url}: cannot connect: {exc}") from exc
    except urllib3.exceptions.TimeoutError as exc:
        raise RetrievalTimeout(f"retrieval server {url}: no answer within env_config.timeout_s={timeout_s} s") \
            from exc
    except urllib3.exceptions.HTTPError as exc:  # refused, reset, unreachable
        raise RetrievalError(f"retrieval server {url}: {type(exc).__name__}: {exc}") from exc
    try:
        payload = json.loads(response.data)
    except ValueError:
        payload = None
    if response.status != 200:
        error = payload.get("error") if isinstance(payload, dict) else response.data[:200]
        hint = f"; {key_hint(key_env)}" if response.status == 401 else ""
        raise RetrievalError(f"retrieval server {url}: HTTP {response.status}: {error}{hint}")
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, list) or not all(isinstance(r, dict) and isinstance(r.get("content"), str)
                                                for r in results):
        raise RetrievalError(f"retrieval server {url}: the answer has no list of results with 'content': "
                             f"{response.data[:200]!r}")
    return results


def health(url: str, timeout_s: float = 2.0) -> str | None:
    """None when ``<url>/health`` answers 200; else why not."""
    import urllib3

    try:
        response = _pool().request("GET", f"{url}/health", timeout=urllib3.Timeout(total=timeout_s))
    except urllib3.exceptions.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if response.status == 200 else f"HTTP {response.status}"
