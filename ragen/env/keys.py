"""The key that ragen's servers (the env server, the retrieval server) want on every request, loopback too.

Any local user can reach a port on 127.0.0.1, and an env server that runs code
runs it as its owner, so no server of ours serves without a key:

- A server reads its key from an environment variable (its ``--key-env``) or,
  where that is unset, generates one and prints it once, as a line to copy
  (``export RAGEN_ENV_KEY=...``), as Jupyter does with its token.
- A client names the variable that holds the key (``key_env`` in its config),
  never the key itself: a command line is readable by every local user.
- A request carries it as ``Authorization: Bearer <key>``, or as HTTP Basic
  auth with the key for password (what a client sends from a netrc file or a
  URL's ``user:key@``, so that clients written for keyless servers, such as
  RAGEN's ``RetrievalClient``, pass it unchanged).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import secrets
from typing import Any
from urllib.parse import urlsplit

from ragen.utils import is_loopback_host

from .config_checks import EnvConfigError, check_http_url

__all__ = ["ENV_SERVER_KEY_ENV", "RETRIEVAL_KEY_ENV", "auth_headers", "authorized", "check_keyed_url",
           "export_line", "key_hint", "new_key", "server_key"]

ENV_SERVER_KEY_ENV = "RAGEN_ENV_KEY"
RETRIEVAL_KEY_ENV = "RAGEN_RETRIEVAL_KEY"


def new_key() -> str:
    """A fresh key: 256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def server_key(key_env: str) -> tuple[str, bool]:
    """``(key, generated)``: the key in the environment variable ``key_env``, or a new one where it is unset or empty."""
    key = os.environ.get(key_env)
    return (key, False) if key else (new_key(), True)


def export_line(key_env: str, key: str) -> str:
    """The line a server prints once with a key it generated: a shell command that gives it to a client."""
    return f"export {key_env}={key}  # the key clients need (generated; set {key_env} before starting to choose it)"


def authorized(header: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``key`` (Bearer, or Basic with it for password)."""
    if not header:
        return False
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "bearer":
        given = value.strip()
    elif scheme.lower() == "basic":
        try:
            given = base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return False
    else:
        return False
    return hmac.compare_digest(given.encode(), key.encode())


def auth_headers(key_env: str) -> dict[str, str]:
    """The header that carries the key of the environment variable ``key_env`` (none where it is unset)."""
    key = os.environ.get(key_env)
    return {"Authorization": f"Bearer {key}"} if key else {}


def key_hint(key_env: str) -> str:
    """What to do about a server that refused the key (HTTP 401), naming the variable the config reads."""
    held = "holds another key" if os.environ.get(key_env) else "is unset"
    return (f"the server wants its key (the one it printed at start, or holds in its --key-env variable) in the "
            f"environment variable {key_env} (env_config.key_env), which {held} here")


def check_keyed_url(field: str, url: Any, key_env: str, server: str) -> str:
    """An ``http(s)://`` URL of a ``server`` (its name in words); beyond loopback, only with the key set, where
    a missing key fails when the config is read rather than at the first request."""
    url = check_http_url(field, url)
    if urlsplit(url).username is not None:
        raise EnvConfigError(field, f"the URL holds a user or key: give the {server}'s key in the environment "
                                    f"variable {key_env} (env_config.key_env), never in a config or command line")
    if not is_loopback_host(urlsplit(url).hostname) and not os.environ.get(key_env):
        raise EnvConfigError(field, f"{url!r} is beyond loopback: set the {server}'s key in the environment "
                                    f"variable {key_env} (env_config.key_env), here and on the server")
    return url
