"""The messages of an env session: OpenEnv's WebSocket protocol.

A session is one WebSocket connection to ``<server>/ws`` (``<server>/<tag>/ws``
on an env server of several tags), holding one env. The client sends JSON
objects ``{"type": "reset", "data": {"seed": ...}}``, ``{"type": "step",
"data": {<action field>: ...}}``, ``{"type": "state"}`` and ``{"type":
"close"}``; the server answers ``{"type": "observation", "data":
{"observation": {...}, "reward": r, "done": d}}``, ``{"type": "state",
"data": {...}}`` or ``{"type": "error", "data": {"message": ..., "code":
...}}``. These are the messages of OpenEnv's ``/ws`` endpoint
(``openenv.core.env_server``), so either side works with OpenEnv's other side.

Our env server's observation is ``{"text": <the env's observation>}``, with
``"info"`` (the step's info) after a step and ``"action_lookup"`` (the env's
actions as ``[id, name]`` pairs, ids kept as JSON gives them) after a reset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ...errors import ProtocolError

__all__ = ["ERROR_CODES", "Reply", "ProtocolError", "error_message", "observation_message", "parse_reply",
           "session_url"]

# OpenEnv's WSErrorCode values
ERROR_CODES = ("INVALID_JSON", "UNKNOWN_TYPE", "VALIDATION_ERROR", "EXECUTION_ERROR", "CAPACITY_REACHED",
               "FACTORY_ERROR", "SESSION_ERROR")


@dataclass(frozen=True)
class Reply:
    """An ``observation`` answer: the observation mapping, its reward (None before any step) and done."""

    observation: dict[str, Any]
    reward: Any
    done: bool


def session_url(server: str, tag: str | None) -> str:
    """The WebSocket URL of a session: ``http(s)://host:port[/base]`` -> ``ws(s)://host:port[/base][/tag]/ws``."""
    parts = urlsplit(server)
    scheme = {"http": "ws", "https": "wss"}[parts.scheme]
    path = parts.path.rstrip("/") + (f"/{tag}" if tag else "") + "/ws"
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def observation_message(observation: dict[str, Any], reward: Any, done: bool) -> str:
    return json.dumps({"type": "observation", "data": {"observation": observation, "reward": reward, "done": done}})


def error_message(code: str, message: str) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code}})


def parse_reply(raw: str | bytes) -> Reply:
    """The server's answer to a reset or a step; ``ProtocolError`` for anything but an
    ``observation`` answer of the right shape (an ``error`` answer's message and code included)."""
    try:
        message = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"the reply is not JSON ({exc}): {_head(raw)}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"the reply is not a JSON object: {_head(raw)}")
    data = message.get("data")
    kind = message.get("type")
    if kind == "error":
        detail = data if isinstance(data, dict) else {}
        raise ProtocolError(f"the server answered with an error ({detail.get('code', 'no code')}): "
                            f"{detail.get('message', _head(raw))}")
    if kind != "observation" or not isinstance(data, dict):
        raise ProtocolError(f"expected an 'observation' reply, got type {kind!r}: {_head(raw)}")
    observation = data.get("observation")
    if not isinstance(observation, dict):
        raise ProtocolError(f"the reply's data.observation is not a JSON object: {_head(raw)}")
    done = data.get("done", False)
    if not isinstance(done, bool):
        raise ProtocolError(f"the reply's data.done is not true or false: {done!r}")
    return Reply(observation, data.get("reward"), done)


def _head(raw: str | bytes, limit: int = 200) -> str:
    text = raw if isinstance(raw, str) else raw.decode("utf-8", "replace")
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
