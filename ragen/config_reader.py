"""One typed reader for the sections of the Hydra config.

Concepts:

- A *section* is a dataclass whose fields are the keys of one config section
  (``agent_proxy``, ``trainer``, ...); a field's annotation is its type, its
  default is the key's default, and ``setting(...)`` adds what the type cannot
  say (``choices``, ``minimum``, ``above``, ``maximum``; on a list, they hold for each
  item). A field typed as another section dataclass is a nested section (typed
  ``Section | None``, one the config may leave out); one typed
  ``dict``/``Mapping`` or ``Any`` is passed through as it is.
- ``read(Section, mapping, "agent_proxy")`` builds the section from plain or
  OmegaConf data. It is strict, and every error names the dotted key: an
  unknown key (with a "did you mean"), a string where a boolean belongs, a
  bool where a number belongs, a number out of range, a required key missing.
- ``check_keys`` is the unknown-key check alone, for sections whose keys are
  listed elsewhere (the engines' ``config_keys``); ``check_setting`` is the
  choices-and-bounds check alone, for a constructor that owns a key's value.
- ``section_keys(Section)`` lists the dotted keys a section knows (the test
  that walks ``config/`` compares them with the YAML).
- ``to_plain``: OmegaConf containers (or any Mapping/Sequence) -> plain dicts
  and lists, without importing omegaconf.

Its errors are ``ragen.errors.ConfigError`` (a ``ValueError``). This module
imports nothing else from ``ragen``: the env, agent-loop and trainer layers all
build on it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from ragen.errors import ConfigError

__all__ = ["check_keys", "check_setting", "read", "section_keys", "setting", "to_plain"]

T = TypeVar("T")


def to_plain(value: Any) -> Any:
    """Plain python copy of ``value``: Mappings -> dict, non-string Sequences -> list.

    OmegaConf's DictConfig/ListConfig are a Mapping/Sequence, so they convert
    here without this module importing omegaconf (interpolations resolve on
    access).
    """
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [to_plain(v) for v in value]
    return value


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            choices: Sequence[Any] | None = None, minimum: float | None = None,
            maximum: float | None = None, above: float | None = None) -> Any:
    """A section field with the checks its annotation cannot express
    (``minimum`` and ``maximum`` inclusive, ``above`` exclusive).

    Without ``default`` (and ``default_factory``) the key is required."""
    metadata = {"choices": tuple(choices) if choices is not None else None, "minimum": minimum, "maximum": maximum,
                "above": above}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def check_setting(key: str, value: Any, *, choices: Sequence[Any] | None = None, minimum: float | None = None,
                  maximum: float | None = None, above: float | None = None) -> Any:
    """``value`` within ``setting``'s ``choices`` and bounds, or the reader's ``ConfigError`` naming ``key``."""
    if choices is not None and value not in choices:
        names = [str(c) for c in choices]
        started = [c for c in names if c.startswith(str(value))]  # a shortened name: the one it begins
        close = started if len(started) == 1 else difflib.get_close_matches(str(value), names, n=1)
        suggestion = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}: unknown {value!r}{suggestion}; choose one of {list(choices)}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value!r}")
    if above is not None and value <= above:
        raise ConfigError(f"{key} must be > {above}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{key} must be <= {maximum}, got {value!r}")
    return value


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def check_keys(data: Mapping, known: Iterable[str], where: str, hint: str = "") -> None:
    """``ConfigError`` naming the first key of ``data`` not in ``known``, with the
    closest known key as a suggestion; ``hint`` ends the message."""
    known = sorted(str(k) for k in known)
    unknown = sorted(str(k) for k in data if str(k) not in known)
    if not unknown:
        return
    key = unknown[0]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    more = f" (unknown keys: {unknown})" if len(unknown) > 1 else ""
    if not hint and not close:
        hint = f"; the keys of {where or 'the config'} are {known}"
    raise ConfigError(f"{_join(where, key)} is not a known key{suggestion}{more}{hint}")


def read(cls: type[T], data: Any, where: str) -> T:
    """The section ``cls`` from the mapping ``data`` (at config path ``where``).

    ``None`` reads as an empty section (a YAML section holding only comments)."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    check_keys(data, fields, where)
    hints = typing.get_type_hints(cls)
    values = {}
    for name, f in fields.items():
        key = _join(where, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key} is missing")
            continue
        values[name] = _value(data[name], hints[name], key, f.metadata)
    return cls(**values)


def section_keys(cls: type, where: str = "") -> set[str]:
    """Every dotted key ``cls`` knows, nested sections walked; a free-form
    field (a ``dict`` or ``Any``) is listed as ``key.*``."""
    keys = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = _join(where, f.name)
        tp = _section_type(hints[f.name]) or hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys |= section_keys(tp, key)
        elif tp is Any or typing.get_origin(tp) in (dict, Mapping) or tp in (dict, Mapping):
            keys.add(key + ".*")
            keys.add(key)
        else:
            keys.add(key)
    return keys


def _section_type(tp: Any) -> type | None:
    """The section dataclass of a ``Section | None`` annotation; None for any other."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) == 1 and dataclasses.is_dataclass(options[0]):
            return options[0]
    return None


def _describe(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if dataclasses.is_dataclass(tp):
        return "a mapping of keys"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple, Sequence):
        return "a list"
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _value(value: Any, tp: Any, key: str, metadata: Mapping) -> Any:
    value = _typed(value, tp, key)
    if isinstance(value, (list, tuple)):  # a list's choices and bounds hold for each item
        for i, item in enumerate(value):
            _checked(item, f"{key}[{i}]", metadata)
        return value
    return _checked(value, key, metadata)


def _checked(value: Any, key: str, metadata: Mapping) -> Any:
    """``value`` within ``metadata``'s choices and bounds, or ``ConfigError`` naming ``key``."""
    if value is None or isinstance(value, (bool, list, tuple, dict)) or dataclasses.is_dataclass(value):
        return value
    return check_setting(key, value, **metadata)


def _typed(value: Any, tp: Any, key: str) -> Any:
    """``value`` as the annotation ``tp`` wants it, or ``ConfigError`` naming ``key``."""
    if tp is Any:
        return to_plain(value)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        section = _section_type(tp)
        if section is not None and isinstance(value, Mapping):  # its own errors name its keys
            return read(section, value, key)
        for option in options:
            if option is type(None):
                continue
            try:
                return _typed(value, option, key)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be {_describe(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return read(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            quoted = " (a string: write true or false without quotes)" if isinstance(value, str) else ""
            raise ConfigError(f"{key} must be true or false, got {value!r}{quoted}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if math.isnan(value):
            raise ConfigError(f"{key} must be a number, got NaN")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key} must be a list of {len(args)} values, got {to_plain(value)!r}")
            items = [_typed(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item = args[0] if args else Any
            items = [_typed(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return to_plain(value)
    raise TypeError(f"{key}: the reader cannot check the type {tp!r}")  # a bug in a section, not in the config
