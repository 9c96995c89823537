"""An env played on an env server: each instance is one session (one kept
WebSocket connection), its state on the server.

- **Session**: opened at the first reset on the next server of the list
  (``servers.ServerChoice``) and kept across resets and rollouts, so the
  connection is made once per env instance, not per step. A reset on a
  session the server has closed (idle, restarted) opens a new one.
- **Failure**: a server that refuses, hangs (no reply within ``timeout_s``),
  closes the connection, answers garbage or more than ``max_message_bytes``
  fails the call with ``RemoteEnvError`` naming the server; a transport
  failure marks the server down for a while. The rollout's env retries then
  play the env again from its seed on a fresh instance, which opens its
  session on another server of the list (``agent_proxy.env_retries``).
- **Key**: when the environment variable ``key_env`` is set, its value goes
  to the server as ``Authorization: Bearer <key>`` (``ragen.env.keys``); a
  server that refuses it (HTTP 401) fails the call with the variable named.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ...errors import RagenError
from ..base import BaseLanguageBasedEnv
from ..keys import auth_headers, key_hint
from .config import RemoteEnvConfig
from .protocol import ProtocolError, Reply, parse_reply, session_url
from .servers import choice_for

__all__ = ["RemoteEnv", "RemoteEnvError", "RemoteEnvTimeout"]

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 2.0  # the closing handshake's wait; the socket is dropped after it


class RemoteEnvError(RagenError, RuntimeError):
    """A remote env call that failed; the message names the server."""


class RemoteEnvTimeout(RemoteEnvError, TimeoutError):
    """An env server that did not answer in time."""


class _SessionGone(RagenError):
    """A kept session the server has closed: a reset opens a new one."""


class RemoteEnv(BaseLanguageBasedEnv):
    """An env of an env server (ours, ``python -m ragen.tools.env_server``, or an OpenEnv server)."""

    config_cls = RemoteEnvConfig

    def __init__(self, config: RemoteEnvConfig | None = None) -> None:
        if config is None:
            raise ValueError("a remote env needs its config: RemoteEnvConfig(url=...)")
        super().__init__(config)
        self.ACTION_LOOKUP: dict[Any, str] | None = None
        self.server: str | None = None
        self._ws: Any = None
        self._text = ""

    # the session -------------------------------------------------------------------------------------------

    def _connect(self) -> None:
        from websockets.sync.client import connect

        choice = choice_for(self.config.servers)
        server = choice.pick(avoid=self.server)
        try:
            ws = connect(session_url(server, self.config.tag), additional_headers=auth_headers(self.config.key_env),
                         open_timeout=self.config.connect_timeout_s, close_timeout=_CLOSE_TIMEOUT_S,
                         max_size=self.config.max_message_bytes, compression=None)
            # entered as websockets asks of a connection (its context manager); the session outlives this call
            # and ``_drop`` closes it
            self._ws = ws.__enter__()
        except Exception as exc:  # refused, unreachable, a handshake refused (401, 404, 503): all end the call
            choice.mark_down(server)
            error = self._error(server, "cannot open a session", exc)
            response = getattr(exc, "response", None)
            status = getattr(response, "status_code", None)
            if status == 401:
                error = RemoteEnvError(f"{error}; {key_hint(self.config.key_env)}")
            elif status == 404:  # a tag the server does not serve: its answer names the tags it does
                said = bytes(getattr(response, "body", None) or b"").decode("utf-8", "replace").strip()[:500]
                error = RemoteEnvError(f"{error}; env_config.tag={self.config.tag!r}: {said or 'not served there'}")
            raise error from exc
        self.server = server

    def _drop(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.close()
            except Exception:  # closing a broken connection is best effort
                logger.debug("closing the session with %s failed", self.server, exc_info=True)

    def _call(self, message: dict[str, Any], what: str, kept: bool = False) -> Reply:
        """Send ``message`` on the session and read the reply; any failure drops the session.
        ``kept``: a session opened before this call, which the server may have closed since
        (``_SessionGone`` when it has)."""
        from websockets.exceptions import ConnectionClosed

        server = self.server
        choice = choice_for(self.config.servers)
        try:
            self._ws.send(json.dumps(message))
            raw = self._ws.recv(timeout=self.config.timeout_s)
        except TimeoutError as exc:
            self._drop()
            choice.mark_down(server)
            raise RemoteEnvTimeout(f"env server {server}: no answer to {what} within "
                                   f"env_config.timeout_s={self.config.timeout_s} s") from exc
        except ConnectionClosed as exc:
            last_words = _last_words(self._ws)
            self._drop()
            if last_words:  # the server said why before it closed (OpenEnv's capacity error)
                choice.mark_down(server)
                raise RemoteEnvError(f"env server {server}: it closed the session at {what}: {last_words}") from exc
            if _closed_for_size(exc, by_server=False):
                raise RemoteEnvError(f"env server {server}: its answer to {what} is larger than "
                                     f"env_config.max_message_bytes={self.config.max_message_bytes}") from exc
            if _closed_for_size(exc, by_server=True):
                raise RemoteEnvError(f"env server {server}: it refused the {what} request as larger than its "
                                     "--max-message-bytes") from exc
            if kept:
                raise _SessionGone() from exc
            choice.mark_down(server)
            raise self._error(server, f"the connection closed during {what}", exc) from exc
        except Exception as exc:  # a socket error: the session is gone whatever it was
            self._drop()
            choice.mark_down(server)
            raise self._error(server, f"{what} failed", exc) from exc
        try:
            return parse_reply(raw)
        except ProtocolError as exc:
            self._drop()
            raise RemoteEnvError(f"env server {server}: {what}: {exc}") from None

    @staticmethod
    def _error(server: str, what: str, exc: BaseException) -> RemoteEnvError:
        return RemoteEnvError(f"env server {server}: {what}: {type(exc).__name__}: {exc}")

    def _text_of(self, reply: Reply, what: str) -> str:
        field = self.config.observation_field
        text = reply.observation.get(field)
        if not isinstance(text, str):
            raise RemoteEnvError(f"env server {self.server}: the observation of {what} has no text field {field!r} "
                                 f"(env_config.observation_field); its fields: {sorted(reply.observation)}")
        self._text = text
        return text

    # the env -----------------------------------------------------------------------------------------------

    def reset(self, seed: int | None = None, mode: str | None = None, **kwargs: Any) -> str:
        data: dict[str, Any] = {"seed": seed} if seed is not None else {}
        if mode is not None:
            data["mode"] = mode
        message = {"type": "reset", "data": data}
        reply = None
        if self._ws is not None:  # a kept session: the server may have closed it since (idle, restarted)
            try:
                reply = self._call(message, "reset", kept=True)
            except _SessionGone:
                pass
        if reply is None:
            self._connect()
            reply = self._call(message, "reset")
        pairs = reply.observation.get("action_lookup")
        self.ACTION_LOOKUP = _lookup(pairs, self.server) if pairs is not None else None
        return self._text_of(reply, "reset")

    def step(self, action: Any) -> tuple[str, float, bool, dict]:
        if self._ws is None:
            raise RemoteEnvError(f"step before reset (or after a failed call): no session with an env server "
                                 f"(servers: {list(self.config.servers)})")
        reply = self._call({"type": "step", "data": {self.config.action_field: action}}, "step")
        info = reply.observation.get("info")
        reward = 0.0 if reply.reward is None else reply.reward
        return self._text_of(reply, "step"), reward, reply.done, info if isinstance(info, dict) else {}

    def render(self, mode: str = "text") -> str:
        return self._text

    def close(self) -> None:
        if self._ws is not None:
            try:
                self._ws.send(json.dumps({"type": "close"}))
            except Exception:  # the server may be gone; the session ends either way
                pass
        self._drop()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_ws"] = None  # a session does not travel: an unpickled env opens its own at reset
        return state


def _closed_for_size(exc: Any, by_server: bool) -> bool:
    """Whether a connection was closed as "message too big" (1009), by the server (our request) or by us (its reply)."""
    first = exc.rcvd if exc.rcvd_then_sent or exc.sent is None else exc.sent
    return first is not None and first.code == 1009 and (first is exc.rcvd) == by_server


def _last_words(ws: Any) -> str | None:
    """A message the server sent before it closed the connection, if one is left to read."""
    try:
        raw = ws.recv(timeout=0)
    except Exception:  # nothing left: the usual case
        return None
    try:
        parse_reply(raw)
    except ProtocolError as exc:
        return str(exc)
    return None


def _lookup(pairs: Any, server: str | None) -> dict[Any, str]:
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[1], str)
                                              for p in pairs):
        raise RemoteEnvError(f"env server {server}: the reset's action_lookup is not a list of [id, name] pairs: "
                             f"{str(pairs)[:200]}")
    return {k if not isinstance(k, list) else tuple(k): v for k, v in pairs}
