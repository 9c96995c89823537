"""Validation of env config values, with errors that name the field.

Concepts:

- ``EnvConfigError``: a ``ConfigError`` (a ``ValueError``) that knows which config field was wrong
  and why. Its text reads ``"<field>: <reason>"``; ``make_env_config`` re-raises
  it with the full config path of the env tag in front, e.g.
  ``custom_envs.LargerSokoban.env_config.num_boxes: 40 boxes do not fit ...``.
- ``check_*`` helpers: cheap type and range checks that env config dataclasses
  call from ``__post_init__``; each returns the (normalised) value.
- ``to_plain``: re-exported from ``ragen.config_reader`` (the one copy).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from ragen.config_reader import to_plain
from ragen.errors import ConfigError

__all__ = [
    "EnvConfigError",
    "check_bool",
    "check_http_url",
    "check_int",
    "check_lookup",
    "check_number",
    "check_str",
    "to_plain",
]


class EnvConfigError(ConfigError):
    """An env config value is invalid; ``field`` names it, ``reason`` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def at(self, prefix: str) -> EnvConfigError:
        """The same error with ``prefix`` (e.g. ``custom_envs.X.env_config``) before the field."""
        return EnvConfigError(f"{prefix}.{self.field}" if prefix else self.field, self.reason)

    def __reduce__(self):  # exceptions cross process boundaries; keep both fields
        return (type(self), (self.field, self.reason))


def check_int(field: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    # bool is an int subclass, but `num_boxes: true` is a config mistake
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise EnvConfigError(field, f"expected an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise EnvConfigError(field, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise EnvConfigError(field, f"must be <= {maximum}, got {value}")
    return value


def check_number(
    field: str, value: Any, minimum: float | None = None, maximum: float | None = None
) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EnvConfigError(field, f"expected a number, got {value!r}")
    value = float(value)
    if value != value:  # NaN compares false to every bound
        raise EnvConfigError(field, "must not be NaN")
    if minimum is not None and value < minimum:
        raise EnvConfigError(field, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise EnvConfigError(field, f"must be <= {maximum}, got {value}")
    return value


def check_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise EnvConfigError(field, f"expected true or false, got {value!r}")
    return value


def check_str(field: str, value: Any, choices: Sequence[str] | None = None) -> str:
    if not isinstance(value, str) or not value.strip():
        raise EnvConfigError(field, f"expected a non-empty string, got {value!r}")
    if choices is not None and value not in choices:
        raise EnvConfigError(field, f"must be one of {list(choices)}, got {value!r}")
    return value


def check_lookup(
    field: str, value: Any, keys: Sequence[int], *, unique_values: bool = False
) -> dict[int, str]:
    """An ``{int id: non-empty str}`` mapping with exactly ``keys`` as ids.

    String ids that spell integers (JSON/CLI overrides) are accepted.
    """
    if not isinstance(value, Mapping):
        raise EnvConfigError(field, f"expected a mapping of ids to strings, got {value!r}")
    out: dict[int, str] = {}
    for k, v in value.items():
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise EnvConfigError(field, f"ids must be integers, got {k!r}")
        if not isinstance(v, str) or not v:
            raise EnvConfigError(field, f"entry {k} must be a non-empty string, got {v!r}")
        out[int(k)] = v
    if sorted(out) != sorted(keys):
        raise EnvConfigError(field, f"ids must be exactly {sorted(keys)}, got {sorted(out)}")
    if unique_values and len(set(out.values())) != len(out):
        raise EnvConfigError(field, f"entries must be distinct, got {out}")
    return out


def check_http_url(field: str, value: Any) -> str:
    """An ``http://`` or ``https://`` URL of a server (a host, a valid port, no query), without a trailing ``/``."""
    from urllib.parse import urlsplit

    url = check_str(field, value)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise EnvConfigError(field, f"{url!r} is not an http:// or https:// URL of a server")
    if not parts.hostname:
        raise EnvConfigError(field, f"{url!r} names no host")
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when it is read
    except ValueError as exc:
        raise EnvConfigError(field, f"{url!r}: {exc}") from None
    if parts.query or parts.fragment:
        raise EnvConfigError(field, f"{url!r}: a server URL takes no query or fragment")
    return url.rstrip("/")
