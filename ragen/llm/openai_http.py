"""The OpenAI engine's HTTP transport: one server's JSON calls with retries, and its errors.

``HTTPTransport`` calls ``{base_url}{route}`` with the standard library only
(``urllib.request`` + ``json``). Connection errors, timeouts, HTTP 429 and 5xx
are retried ``max_retries`` times with exponential backoff (``backoff_s``,
doubling), then raise ``ServerUnavailable``; other 4xx are not (the request
itself is wrong): ``RefusedError``. ``timeout_s`` is the socket timeout of one
attempt. A reply that is not JSON is ``MalformedReply`` (not retried: the
server answered). ``closed`` ends a back-off: no retry starts after it. Every
request of an episode carries the header ``X-Session-ID: {seed}-{env_id}``
(``session_key``), which a router in front of several servers (vllm-router's
``consistent_hash`` and ``sticky_least_loaded``) reads to send an episode's
turns to one server, whose prefix cache holds the episode so far; a single
``vllm serve`` ignores it.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ragen.errors import RagenError
from ragen.llm.types import GenerationRequest

logger = logging.getLogger(__name__)


class _RetryableError(RagenError):
    pass


class ServerUnavailable(RagenError, RuntimeError):
    """The server gave no usable answer to a request: none within its retries (connection
    refused or dropped, timeouts, 429 or 5xx every time), or a malformed one."""


class MalformedReply(ServerUnavailable):
    """The server's reply is not a completion: not JSON, no choices, a field of the wrong
    type, or token ids that are not the model's."""


class RefusedError(RagenError, RuntimeError):
    """An HTTP 4xx other than 429: the server refuses the request itself (no retry)."""


def malformed(base_url: str, route: str, why: str) -> MalformedReply:
    """The ``MalformedReply`` of ``route`` at ``base_url``, saying ``why``."""
    return MalformedReply(f"malformed reply from {base_url}{route}: {why}")


# The header a router reads as the session key (vllm-router checks it first, before any body field).
SESSION_HEADER = "X-Session-ID"


def session_key(request: GenerationRequest) -> str:
    """The episode's identity, ``{seed}-{env_id}``: the same for all its turns, sent as ``SESSION_HEADER``."""
    return f"{request.seed}-{request.env_id}"


def checked_url(url: Any, key: str) -> str:
    """``url`` without a trailing slash; ValueError naming ``key`` unless it is an http(s) URL with a host."""
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{key}={url!r} is not a server URL such as http://127.0.0.1:8000/v1")
    return url.rstrip("/")


class HTTPTransport:
    """JSON calls to one OpenAI-compatible server, retried; see the module docstring."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, max_retries: int,
                 backoff_s: float) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.closed = threading.Event()  # set: a back-off ends at once, and no retry follows

    def post(self, route: str, body: dict[str, Any], session: str | None = None) -> dict[str, Any]:
        return self.call_with_retries("POST", route, body, session)

    def call_with_retries(self, method: str, route: str, body: dict[str, Any] | None,
                          session: str | None = None) -> dict[str, Any]:
        for attempt in range(self.max_retries + 1):
            try:
                return self._call(method, route, body, session)
            except _RetryableError as exc:
                if attempt == self.max_retries:
                    raise ServerUnavailable(f"{exc} (after {attempt + 1} attempts)") from exc
                delay = self.backoff_s * (2**attempt)
                logger.debug("OpenAIEngine: %s; retry %d in %.2f s", exc, attempt + 1, delay)
                if self.closed.wait(delay):  # close() ends the wait: no retry after it
                    raise ServerUnavailable(f"{exc}; the engine was closed before a retry") from exc
        raise AssertionError("unreachable")

    def _call(self, method: str, route: str, body: dict[str, Any] | None,
              session: str | None = None) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if session is not None:
            headers[SESSION_HEADER] = session
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        http_request = urllib.request.Request(self.base_url + route, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(http_request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            message = f"HTTP {exc.code} from {self.base_url}{route}: {detail}"
            if exc.code == 429 or exc.code >= 500:
                raise _RetryableError(message) from exc
            raise RefusedError(message) from exc
        except (urllib.error.URLError, http.client.HTTPException, socket.timeout, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise _RetryableError(f"{type(exc).__name__} from {self.base_url}{route}: {reason}") from exc
        try:
            return json.loads(raw)
        except ValueError as exc:  # not JSON, or not text: e.g. a proxy's error page
            raise malformed(self.base_url, route, f"not JSON ({exc}): {raw[:100]!r}") from None
