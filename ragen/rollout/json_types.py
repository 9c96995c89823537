"""Whether a value read from JSON has the type a dataclass field is annotated with
(``is_a``, ``check_fields``; a ``TypedDict``'s keys: ``check_keys``), for files
that are input (``ragen.rollout.dump``): a field of the wrong type, or lists
and dicts nested past ``MAX_NESTING``, is a ``BadField`` naming it."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Callable, Union

from ragen.errors import RagenError

# free-form values (an env's info and config) nest at most this deep: deeper ones would overflow the
# recursion of the code that renders or builds from them
MAX_NESTING = 64


class BadField(RagenError, ValueError):
    """A field of a line that has the wrong type; the message names the field."""


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= limit else text[:limit] + '...'}"


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(obj: Any, prefix: str) -> None:
    """Raise ``BadField`` naming the first field of dataclass ``obj`` whose
    value does not have its annotated type."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not is_a(value, hints[f.name]):
            name = f"{prefix}.{f.name}" if prefix else f.name
            if depth(value) > MAX_NESTING:
                raise BadField(f"{name}: lists and dicts nested more than {MAX_NESTING} deep")
            check_keys(value, hints[f.name], name)
            raise BadField(f"{name}: expected {type_name(hints[f.name])}, got {short(value)}")


def check_keys(value: Any, hint: Any, name: str) -> None:
    """Where ``hint`` is a ``TypedDict`` (or one or None) and ``value`` a dict: raise ``BadField``
    naming the key of ``value`` that is missing, unknown or not of its type."""
    typed = next((h for h in (hint, *typing.get_args(hint)) if typing.is_typeddict(h)), None)
    if typed is None or not isinstance(value, dict):
        return
    hints = _hints(typed)
    missing, unknown = [k for k in hints if k not in value], [k for k in value if k not in hints]
    if missing or unknown:
        raise BadField(f"{name}: missing key(s) {missing}, unknown key(s) {unknown}; expected the keys "
                       f"{list(hints)}")
    for key, item_hint in hints.items():
        if not is_a(value[key], item_hint):
            raise BadField(f"{name}.{key}: expected {type_name(item_hint)}, got {short(value[key])}")


_SCALARS = {str: {str}, int: {int}, float: {int, float}, bool: {bool}}  # the JSON types each one reads from


def is_a(value: Any, hint: Any) -> bool:
    """Whether ``value`` (read from JSON) has type ``hint``: str, int, float
    (an int too), bool, None, unions, list/tuple/dict of those, ``TypedDict``s
    (exactly their keys), classes."""
    return _checker(hint)(value)


@functools.lru_cache(maxsize=None)
def _checker(hint: Any) -> Callable[[Any], bool]:
    """``is_a`` for one hint, worked out once: a dump checks the same few hints on every line."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return lambda v: depth(v) <= MAX_NESTING
    if typing.is_typeddict(hint):  # a dict with exactly its keys, each of its type
        items = {k: _checker(h) for k, h in _hints(hint).items()}
        return lambda v: isinstance(v, dict) and v.keys() == items.keys() and all(c(v[k]) for k, c in items.items())
    if hint in _SCALARS:
        types_ = _SCALARS[hint]
        return lambda v: type(v) in types_
    if origin is Union or origin is types.UnionType:
        checks = [_checker(a) for a in args]
        return lambda v: any(c(v) for c in checks)
    if hint is type(None) or hint is None:
        return lambda v: v is None
    if origin in (list, tuple):
        if not args:
            return lambda v: isinstance(v, origin)
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            if args[0] in _SCALARS:  # token ids, log-probs: thousands per turn, checked by their types at once
                types_ = _SCALARS[args[0]]
                return lambda v: isinstance(v, origin) and {type(x) for x in v} <= types_
            each = _checker(args[0])
            return lambda v: isinstance(v, origin) and all(each(x) for x in v)
        checks = [_checker(a) for a in args]
        return lambda v: isinstance(v, origin) and len(v) == len(checks) and all(c(x) for c, x in zip(checks, v))
    if origin is dict:
        key, val = _checker(args[0]), _checker(args[1])
        return lambda v: isinstance(v, dict) and all(key(k) and val(x) for k, x in v.items())
    if isinstance(hint, type):
        return lambda v: isinstance(v, hint)
    return lambda v: True  # an annotation this reader does not know: not refused


def depth(value: Any) -> int:
    """How deep lists and dicts nest in ``value`` (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            if d >= MAX_NESTING:  # deep enough to refuse: stop walking
                return d + 1
            deepest = max(deepest, d + 1)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (Union, types.UnionType):  # a TypedDict's name without its module
        return " | ".join("None" if a is type(None) else type_name(a) for a in typing.get_args(hint))
    return hint.__name__ if isinstance(hint, type) and not typing.get_args(hint) else str(hint).replace("typing.", "")
