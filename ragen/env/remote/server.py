"""An env server: envs of several tags, one per session, over OpenEnv's
WebSocket session protocol (``protocol.py``).

A session is a WebSocket connection to ``/<tag>/ws`` (also ``/ws`` when the
server has one tag, as an OpenEnv server); it makes its own env and keeps it
until the connection closes. ``GET /health`` (and ``/<tag>/health``) answers
``{"status": "healthy"}``. Bounds: at most ``max_sessions`` sessions (more are
refused with HTTP 503), requests of at most ``max_message_bytes`` (a larger
one closes its session), a session idle for ``idle_timeout_s`` is closed, and
a client that does not read its answers is dropped once more than
``max_send_queue_bytes`` of them wait for it: a session's answers go through
a bounded send queue of its own (``ragen.send_queue``), as the LLM manager's
do, so its thread never blocks on a client that stopped reading.
An env that raises ends its session after the error answer: its state is
unknown, and the client retries on a fresh session.
A session needs the server's ``key`` (``Authorization: Bearer <key>``; HTTP
401 otherwise), on loopback too (``ragen.env.keys``); a server given none
makes one (``key``). Each session runs on its own thread; env calls are not
time-bound here, the client bounds its wait for each answer.
"""

from __future__ import annotations

import json
import logging
import numbers
import socket
import threading
import weakref
from http import HTTPStatus
from typing import Any, Callable, Mapping

from ...errors import RagenError
from ...send_queue import SendQueue
from ..background import BackgroundServer
from ..base import action_lookup, plain_info, reset_takes_mode
from ..keys import authorized, new_key
from .protocol import error_message, observation_message

__all__ = ["DEFAULT_MAX_SEND_QUEUE_BYTES", "EnvServer"]

logger = logging.getLogger(__name__)

# What may wait to be sent to one client before it is dropped. A client reads
# each answer before it sends its next request, so what waits for it is about
# one answer at most.
DEFAULT_MAX_SEND_QUEUE_BYTES = 4 * 1024 * 1024


class _BadRequest(RagenError):
    """A message the session cannot serve; answered with an error message, the session goes on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _QueuedSocket:
    """A client's socket as websockets' connection uses it, its sends through a
    ``SendQueue``: ``sendall`` never blocks, and raises ConnectionError (an
    OSError, which websockets takes for a broken connection) once the client
    is dropped; the end of the stream waits for what is queued."""

    def __init__(self, sock: socket.socket, max_queued_bytes: int) -> None:
        try:
            peer = "%s:%s" % sock.getpeername()[:2]
        except OSError:  # the client left already: its first send fails
            peer = "a client that left"
        self._sock = sock
        self.queue = SendQueue(sock, peer, max_queued_bytes, server="env server", bound_name="max_send_queue_bytes",
                               sender_name="ragen-env-send")

    def sendall(self, data: bytes) -> None:
        self.queue.send_frame(data)

    def shutdown(self, how: int) -> None:
        if how == socket.SHUT_WR:
            self.queue.shutdown_write()
        else:
            self.queue.close()

    def close(self) -> None:
        self.queue.close()  # its sender stopped first: a send in progress does not outlive the socket
        self._sock.close()

    def __getattr__(self, name: str) -> Any:  # recv, fileno, settimeout, getpeername, ...: the socket's own
        return getattr(self._sock, name)


class EnvServer(BackgroundServer):
    """Serves ``makers`` (tag -> a function making a new env of it) on ``host``:``port`` (0: a free port)
    to clients that hold ``key`` (None: a new one, ``self.key``)."""

    thread_name = "ragen-env-server"

    def __init__(self, makers: Mapping[str, Callable[[], Any]], host: str = "127.0.0.1", port: int = 0,
                 key: str | None = None, max_sessions: int = 256, max_message_bytes: int = 1024 * 1024,
                 idle_timeout_s: float = 300.0, max_send_queue_bytes: int = DEFAULT_MAX_SEND_QUEUE_BYTES) -> None:
        from websockets.sync.server import serve

        if not makers:
            raise ValueError("an env server needs at least one tag to serve")
        if isinstance(max_send_queue_bytes, bool) or not isinstance(max_send_queue_bytes, int) or \
                max_send_queue_bytes < 1:
            raise ValueError(f"max_send_queue_bytes must be a positive integer, got {max_send_queue_bytes!r}")
        self.makers = dict(makers)
        self.key = key or new_key()
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.max_send_queue_bytes = max_send_queue_bytes
        self.sessions = 0
        self.sessions_served = 0
        self._lock = threading.Lock()
        self._connections: weakref.WeakSet = weakref.WeakSet()  # closed at shutdown (websockets < 17 leaves them)
        self._server = serve(self._session, host, port, process_request=self._route, max_size=max_message_bytes,
                             compression=None, server_header=None, close_timeout=2,
                             create_connection=self._connection)
        self.host, self.port = self._server.socket.getsockname()[:2]

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def _stop(self) -> None:
        self._server.shutdown()
        # websockets 17's shutdown closes the open sessions, 16's does not: close them here, at once
        # (each waits for its client's close frame up to close_timeout, so on threads of their own)
        with self._lock:
            open_ = list(self._connections)
        closers = [threading.Thread(target=conn.close, args=(1001, "the env server is shutting down"), daemon=True)
                   for conn in open_]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(timeout=5)

    def _connection(self, sock: socket.socket, *args: Any, **kwargs: Any) -> Any:
        """websockets' connection of a new client, sending through a bounded queue of its own."""
        from websockets.sync.server import ServerConnection

        conn = ServerConnection(_QueuedSocket(sock, self.max_send_queue_bytes), *args, **kwargs)
        with self._lock:
            self._connections.add(conn)
        return conn

    # HTTP: which path, health, key, capacity ----------------------------------------------------------------

    def _tag_of(self, path: str) -> tuple[str | None, str]:
        """(tag, endpoint) of a request path: ``/<tag>/ws`` -> (tag, "ws"); ``/ws`` -> (the only tag, "ws")."""
        parts = path.split("?", 1)[0].strip("/").split("/")
        if len(parts) == 1:
            only = next(iter(self.makers)) if len(self.makers) == 1 else None
            return only, parts[0]
        if len(parts) == 2 and parts[0] in self.makers:
            return parts[0], parts[1]
        return None, ""

    def _route(self, connection: Any, request: Any) -> Any:
        tag, endpoint = self._tag_of(request.path)
        if endpoint == "health":
            response = connection.respond(HTTPStatus.OK, json.dumps({"status": "healthy", "tags": list(self.makers)}))
            response.headers["Content-Type"] = "application/json"
            return response
        if endpoint != "ws" or tag is None:
            return connection.respond(HTTPStatus.NOT_FOUND, f"no such endpoint {request.path!r}: sessions are at "
                                      f"/<tag>/ws for the tags {list(self.makers)}\n")
        if not authorized(request.headers.get("Authorization"), self.key):
            return connection.respond(HTTPStatus.UNAUTHORIZED, "this env server needs its key: "
                                      "Authorization: Bearer <key>\n")
        if self.sessions >= self.max_sessions:
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE,
                                      f"this env server has its {self.max_sessions} sessions open\n")
        return None

    # a session ----------------------------------------------------------------------------------------------

    def _session(self, ws: Any) -> None:
        tag, _ = self._tag_of(ws.request.path)
        with self._lock:
            full = self.sessions >= self.max_sessions
            if not full:
                self.sessions += 1
                self.sessions_served += 1
        if full:  # another handshake took the last place after this one's was checked
            ws.send(error_message("CAPACITY_REACHED", f"this env server has its {self.max_sessions} sessions open"))
            ws.close()
            return
        env = None
        try:
            env = self.makers[tag]()
            self._serve_session(ws, tag, env)
        except Exception as exc:  # a session's own failure (the env could not be made, the connection broke)
            logger.debug("session of %s ended: %s", tag, exc, exc_info=True)
            try:
                ws.send(error_message("FACTORY_ERROR" if env is None else "SESSION_ERROR",
                                      f"{type(exc).__name__}: {exc}"))
            except Exception:  # the connection is gone
                pass
        finally:
            with self._lock:
                self.sessions -= 1
            if env is not None:
                try:
                    env.close()
                except Exception:  # closing is best effort
                    logger.debug("env close failed", exc_info=True)
            ws.close()

    def _serve_session(self, ws: Any, tag: str, env: Any) -> None:
        from websockets.exceptions import ConnectionClosed

        state = {"tag": tag, "seed": None, "step_count": 0, "reset": False}
        while True:
            try:
                raw = ws.recv(timeout=self.idle_timeout_s)
            except TimeoutError:
                logger.info("closing an idle session of %s (no message in %s s)", tag, self.idle_timeout_s)
                return
            except ConnectionClosed:
                return
            try:
                message = json.loads(raw)
                if not isinstance(message, dict):
                    raise _BadRequest("INVALID_JSON", "a message is a JSON object")
                kind = message.get("type")
                if kind == "close":
                    return
                answer = self._answer(env, kind, message.get("data"), state)
            except ValueError as exc:  # json's JSONDecodeError included
                answer = error_message("INVALID_JSON", f"Invalid JSON: {exc}")
            except _BadRequest as exc:
                answer = error_message(exc.code, str(exc))
            except Exception as exc:  # the env's own code failed: its state is unknown, so the session ends
                logger.warning("env %s (seed %s) failed: %s: %s", tag, state["seed"], type(exc).__name__, exc)
                ws.send(error_message("EXECUTION_ERROR", f"{type(exc).__name__}: {exc}"))
                return
            try:
                ws.send(answer)  # never blocks: a client that does not read is dropped instead (_QueuedSocket)
            except ConnectionClosed:
                return

    def _answer(self, env: Any, kind: Any, data: Any, state: dict[str, Any]) -> str:
        if kind == "state":
            return json.dumps({"type": "state", "data": {k: state[k] for k in ("tag", "seed", "step_count")}})
        if kind not in ("reset", "step"):
            raise _BadRequest("UNKNOWN_TYPE", f"Unknown message type: {kind!r}")
        if not isinstance(data, dict):
            raise _BadRequest("VALIDATION_ERROR", f"a {kind} message's data is a JSON object, got {data!r}")
        if kind == "reset":
            seed = data.get("seed")
            if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
                raise _BadRequest("VALIDATION_ERROR", f"seed must be an integer, got {seed!r}")
            kwargs = {"mode": data["mode"]} if "mode" in data and reset_takes_mode(type(env)) else {}
            obs = _text(env.reset(seed=seed, **kwargs), "reset")
            state.update(seed=seed, step_count=0, reset=True)
            lookup = action_lookup(env)
            observation = {"text": obs}
            if lookup:
                observation["action_lookup"] = [[k, str(v)] for k, v in lookup.items()]
            return observation_message(observation, None, False)
        if not state["reset"]:
            raise _BadRequest("SESSION_ERROR", "step before reset")
        if "message" not in data:
            raise _BadRequest("VALIDATION_ERROR", f"a step's data holds the action as 'message', got keys {sorted(data)}")
        obs, reward, done, info = env.step(data["message"])
        state["step_count"] += 1
        return observation_message({"text": _text(obs, "step"), "info": plain_info(info)}, _number(reward),
                                   bool(done))


def _text(obs: Any, method: str) -> str:
    if not isinstance(obs, str):
        raise TypeError(f"the env's {method} returned {type(obs).__name__}, not the observation text")
    return obs


def _number(reward: Any) -> int | float:
    """A reward as JSON keeps it: an int stays an int (a prompt shows RAGEN's ``0``), numpy scalars as Python's."""
    if type(reward) in (int, float):
        return reward
    if isinstance(reward, numbers.Real) and not isinstance(reward, bool):
        return reward.item() if hasattr(reward, "item") else float(reward)
    raise TypeError(f"the env's step returned a reward of type {type(reward).__name__}, not a number")
