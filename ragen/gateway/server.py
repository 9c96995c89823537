"""``GatewayServer``: the gateway over HTTP, speaking the OpenAI API, a base URL per session.

Routes (every one answers JSON; a refusal is OpenAI's error body):

- ``POST /sessions`` (the server's key): a new session, ``{"id", "base_url", "api_key"}``;
  ``DELETE /sessions/<id>`` (the server's or the session's key) closes it; ``GET /metrics``
  (the server's key): every session's counts summed (``Sessions.metrics``).
- ``GET /sessions/<id>/v1/models``; ``POST /sessions/<id>/v1/chat/completions``,
  ``POST /sessions/<id>/v1/completions`` and ``POST /sessions/<id>/v1/responses``, each with
  the session's key as the bearer token. ``stream: true`` answers with server-sent events,
  the first sent before the engine's answer, then the answer's text as the engine samples
  it (``TextStream``: what may not be content, such as a tool call, held back), then the
  rest of the answer (its tool calls, finish reason and usage), ending with ``data: [DONE]``.

One thread serves each connection, at most ``max_connections`` at once (the next
gets a 503); a client that sends or reads nothing for ``io_timeout_s`` is dropped, so
one that stops reading its stream holds only its own thread. ``close`` ends every
connection still open (a client's kept alive, an abandoned agent's), so no thread of
the server outlives it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import re
import secrets
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable

from ragen.gateway.api_error import ApiError
from ragen.gateway.calls import ChatCall, read_chat, read_text
from ragen.gateway.gateway import Gateway, OnTokens
from ragen.gateway.record import CallRecord
from ragen.gateway.replies import Answer, ChatChunks, TextChunks, chat_completion, text_completion
from ragen.gateway.responses import ResponseEvents, read_responses, response_object
from ragen.gateway.session import Session
from ragen.gateway.streaming import TextStream
from ragen.llm.tool_calls import CALL_OPEN
from ragen.serving.address import check_listen_address, is_loopback

logger = logging.getLogger(__name__)

Chunks = ChatChunks | TextChunks | ResponseEvents  # a stream's events: head, delta, tail, error

_SESSION_PATH = re.compile(r"^/sessions/([0-9a-f]{1,64})(/v1/[a-z/]+)?$")
CLOSE_GRACE_S = 5.0  # close() waits this long for a connection's call in flight to end


class GatewayServer:
    """``gateway`` served on ``host:port`` (0: a free port). ``key``: the server's own key, for
    opening and closing sessions; a host beyond loopback needs one given."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0, key: str | None = None) -> None:
        check_listen_address(host, port, "gateway")
        if key is None and not is_loopback(host):
            raise ValueError(f"gateway.host={host!r} is beyond this machine: give the server a key (in the "
                             "environment variable gateway.key_env names) so that strangers cannot open sessions")
        self.gateway = gateway
        self.key = key or "sk-ragen-server-" + secrets.token_urlsafe(24)
        self._http = _HTTPServer((host, port), _Handler, self)
        self.host, self.port = self._http.server_address[:2]
        self._thread = threading.Thread(target=self._http.serve_forever, name="ragen-gateway", daemon=True)
        self._thread.start()
        logger.info("gateway listening on http://%s:%d", self.host, self.port)

    def base_url(self, session: Session) -> str:
        return f"http://{self.host}:{self.port}/sessions/{session.id}/v1"

    def open_session(self, seed: int | None = None, env_id: int | None = None) -> Session:
        return self.gateway.sessions.open(seed, env_id)

    @property
    def connections(self) -> int:
        """The HTTP connections open now."""
        return self._http.active

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Stops serving and ends every connection still open: a client's kept alive between its
        calls, or an agent's thread abandoned at its timeout, holds no thread of the server after.
        A connection's thread in the middle of a call ends once the engine answers it; it is waited
        for within ``grace_s``."""
        self._http.shutdown()
        self._http.server_close()
        self._http.end_connections(grace_s)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog (socketserver's 5 reset clients that connect together)

    def __init__(self, address: tuple[str, int], handler: type, owner: GatewayServer) -> None:
        self.owner = owner
        self._open: dict[socket.socket, threading.Thread] = {}  # each connection's thread
        self._active_lock = threading.Lock()
        super().__init__(address, handler)

    @property
    def active(self) -> int:
        with self._active_lock:
            return len(self._open)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        """A thread of its own for the connection, kept (socketserver's daemon threads are not, and
        its shutdown leaves their connections open)."""
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name="ragen-gateway-conn", daemon=True)
        with self._active_lock:
            full = len(self._open) >= self.owner.gateway.settings.max_connections
            if not full:
                self._open[request] = thread
        if full:
            _refuse_connection(request, self.owner.gateway.settings.max_connections)
            self.shutdown_request(request)
            return
        thread.start()

    def end_connections(self, grace_s: float) -> None:
        """Every open connection shut (a thread waiting for its next request reads its end), and
        their threads joined within ``grace_s``."""
        with self._active_lock:
            connections = dict(self._open)
        for sock in connections:
            with contextlib.suppress(OSError):  # closed meanwhile
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + grace_s
        for thread in connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection's failure outside a request's handling: a client that went away or went quiet
        (between keep-alive requests) is usual, logged at debug; anything else is logged with its
        traceback (socketserver prints it to stderr)."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            logger.debug("gateway: connection from %s ended: %s", client_address, sys.exc_info()[1])
            return
        logger.exception("gateway: connection from %s failed", client_address)

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._active_lock:
                self._open.pop(request, None)


def _refuse_connection(sock: socket.socket, limit: int) -> None:
    body = json.dumps(ApiError(503, f"the gateway serves {limit} connections at once (gateway.max_connections)",
                               code="too_many_connections").body()).encode()
    try:
        sock.settimeout(1.0)
        sock.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    except OSError:
        pass  # the client went away: nothing to tell it


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a reply's head and body go out at once, not the body held for the client's delayed ACK
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.owner.gateway.settings.io_timeout_s)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        logger.debug("gateway %s: " + format, self.address_string(), *args)

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        try:
            self._route(method)
        except ApiError as exc:
            self._json(exc.status, exc.body(), exc.headers())
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True  # the client went away or stopped reading
        except Exception as exc:  # noqa: BLE001 - a bug here answers this request alone, the server goes on
            logger.exception("gateway: %s %s failed", method, self.path)
            self._json(500, ApiError(500, f"the gateway failed: {type(exc).__name__}: {exc}").body())

    def _route(self, method: str) -> None:
        gateway = self.server.owner.gateway
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/sessions" and method == "POST":
            self._server_key()
            body = self._body() if self.headers.get("Content-Length", "0") != "0" else {}
            session = self.server.owner.open_session(*_seed_and_env(body))
            self._json(200, {"id": session.id, "base_url": self.server.owner.base_url(session),
                             "api_key": session.key})
            return
        if path == "/metrics" and method == "GET":
            self._server_key()
            self._json(200, gateway.sessions.metrics())
            return
        match = _SESSION_PATH.match(path)
        if match is None:
            raise ApiError(404, f"no route {method} {path}: a session's API is under /sessions/<id>/v1",
                           code="not_found")
        session_id, api = match.group(1), match.group(2)
        if api is None and method == "DELETE":
            self._close(session_id)
            return
        session = gateway.sessions.get(session_id, self._bearer())
        if (method, api) == ("GET", "/v1/models"):
            self._json(200, {"object": "list", "data": [{"id": gateway.link.served_name, "object": "model",
                                                         "created": 0, "owned_by": "ragen"}]})
        elif (method, api) == ("POST", "/v1/chat/completions"):
            self._chat(gateway, session)
        elif (method, api) == ("POST", "/v1/completions"):
            self._text(gateway, session)
        elif (method, api) == ("POST", "/v1/responses"):
            self._responses(gateway, session)
        else:
            raise ApiError(404 if method in ("GET", "POST") else 405, f"no route {method} {api} for a session",
                           code="not_found")

    def _chat(self, gateway: Gateway, session: Session) -> None:
        call = read_chat(self._body(), gateway.settings.max_messages)
        decode = gateway.link.decode if call.sampling.logprobs else None
        self._play(session, "chat.completions",
                   lambda record, on_tokens: gateway.chat(session, call, record, on_tokens),
                   lambda answer: chat_completion(answer, decode),
                   (lambda record: ChatChunks(call.model or gateway.link.served_name,
                                              f"chatcmpl-{session.id}-{record.index}", call.include_usage, decode))
                   if call.stream else None, _chat_text(gateway, call))

    def _text(self, gateway: Gateway, session: Session) -> None:
        call = read_text(self._body())
        decode = gateway.link.decode if call.sampling.logprobs else None
        self._play(session, "completions", lambda record, on_tokens: gateway.text(session, call, record, on_tokens),
                   lambda answer: text_completion(answer, decode),
                   (lambda record: TextChunks(call.model or gateway.link.served_name,
                                              f"cmpl-{session.id}-{record.index}", call.include_usage, decode))
                   if call.stream else None,
                   TextStream(gateway.link.decode_text, gateway.stops(call.sampling)))

    def _responses(self, gateway: Gateway, session: Session) -> None:
        call = read_responses(self._body(), gateway.settings.max_messages)

        def play(record: CallRecord, on_tokens: OnTokens | None) -> Answer:
            answer = gateway.chat(session, call, record, on_tokens)
            return dataclasses.replace(answer, id=f"resp_{session.id}_{record.index}")

        self._play(session, "responses", play, lambda answer: response_object(answer, call),
                   (lambda record: ResponseEvents(call, f"resp_{session.id}_{record.index}")) if call.stream else None,
                   _chat_text(gateway, call))

    def _play(self, session: Session, endpoint: str, play: Callable[[CallRecord, OnTokens | None], Answer],
              whole: Callable[[Answer], dict[str, Any]], chunks: Callable[[CallRecord], Chunks] | None,
              text: TextStream) -> None:
        """One call of ``session``: played, recorded, and answered whole, or (``chunks``: those of its
        stream, given its record) streamed, its ``text`` sent as the engine samples it."""
        t0 = time.perf_counter()
        record = session.begin(endpoint, self.server.owner.gateway.settings.max_calls_per_session)
        try:
            if chunks is None:
                self._json(200, whole(_played(record, play, None)))
            else:
                self._stream(record, play, chunks(record), text)
        finally:
            record.total_s = time.perf_counter() - t0
            session.end(record)

    def _stream(self, record: CallRecord, play: Callable[[CallRecord, OnTokens | None], Answer], chunks: Chunks,
                text: TextStream) -> None:
        """A streamed call: its first events before the engine answers, then its text as the engine
        samples it (held back where it may not be content), then the rest of the answer."""
        self._stream_head()
        self._events(chunks.head(), chunks.named)
        try:
            answer = _played(record, play, lambda ids: self._events(chunks.delta(text.push(ids)), chunks.named))
        except ApiError as exc:
            self._events(chunks.error(exc.body()), chunks.named)
        else:
            self._events(chunks.tail(answer, text.rest(answer.content)), chunks.named)
        self._end_stream()

    def _close(self, session_id: str) -> None:
        sessions = self.server.owner.gateway.sessions
        key = self._bearer()
        if not (key is not None and hmac.compare_digest(key.encode(), self.server.owner.key.encode())):
            sessions.get(session_id, key)  # the session's own key closes it too (401/404 otherwise)
        if sessions.close(session_id) is None:
            raise ApiError(404, f"session {session_id} is not open", code="session_not_found")
        self._json(200, {"id": session_id, "closed": True})

    def _server_key(self) -> None:
        key = self._bearer()
        if key is None or not hmac.compare_digest(key.encode(), self.server.owner.key.encode()):
            raise ApiError(401, "opening a session needs the gateway server's key as the bearer token",
                           code="invalid_api_key")

    def _bearer(self) -> str | None:
        value = self.headers.get("Authorization", "")
        return value[7:].strip() or None if value[:7].lower() == "bearer " else None

    def _body(self) -> Any:
        """The request's JSON body, within ``max_body_bytes`` (413 past it, 411 without a length)."""
        limit = self.server.owner.gateway.settings.max_body_bytes
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise ApiError(411, "the request needs a Content-Length", code="length_required")
        if int(length) > limit:
            self.close_connection = True  # its body is left unread
            raise ApiError(413, f"the request body has {length} bytes, more than this gateway's bound of {limit} "
                           "(gateway.max_body_bytes)", code="body_too_large")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the request body nests deeper than JSON is read here", code="invalid_json") from None

    def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _stream_head(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _events(self, events: Iterable[dict[str, Any]], named: bool = False) -> None:
        for event in events:
            head = f"event: {event['type']}\n".encode() if named else b""
            self._chunk(head + b"data: " + json.dumps(event).encode() + b"\n\n")

    def _end_stream(self) -> None:
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def _chat_text(gateway: Gateway, call: ChatCall) -> TextStream:
    """A chat call's streamed text: with tools, none from a call's opening on, nor the white space
    before it (the content is what comes before the calls, stripped)."""
    tools = bool(call.tools) and call.tool_choice != "none"
    return TextStream(gateway.link.decode_text, gateway.stops(call.sampling) + ([CALL_OPEN] if tools else []),
                      strip_end=tools)


def _played(record: CallRecord, play: Callable[[CallRecord, OnTokens | None], Answer],
            on_tokens: OnTokens | None) -> Answer:
    """``play``'s answer; its failure recorded on ``record``, and raised."""
    try:
        return play(record, on_tokens)
    except ApiError as exc:
        record.error, record.finish_reason = exc.message, "error"
        raise
    except Exception as exc:
        record.error, record.finish_reason = f"{type(exc).__name__}: {exc}", "error"
        raise


def _seed_and_env(body: Any) -> tuple[int | None, int | None]:
    """A new session's request key (its seed and env id), where ``POST /sessions`` gives them."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body of POST /sessions must be a JSON object", code="invalid_json")
    out = []
    for name in ("seed", "env_id"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ApiError(400, f"{name} must be an integer", param=name, code="invalid_value")
        out.append(value)
    return out[0], out[1]
