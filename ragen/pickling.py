"""Naming what does not pickle.

Env configs travel to worker processes in every ``EnvSpec``, and the env
checker pickles configs and envs; when pickling fails, Python's error rarely
says which key or attribute is at fault. ``describe_unpicklable`` says it.

It sits at the top of the package, on no other ragen module, because both the
env layer (the checker) and the agent loop (the parallel rollout) call it, and
the env layer must not import the agent loop.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Mapping
from typing import Any

__all__ = ["describe_unpicklable"]


def describe_unpicklable(obj: Any, prefix: str) -> str | None:
    """None when ``obj`` pickles; else what does not, e.g.
    ``"env_config.hook (a _thread.lock: TypeError: cannot pickle ...)"``.
    Callers that send configs to worker processes can use it to name the key."""
    try:
        pickle.dumps(obj)
        return None
    except Exception as exc:
        part = _unpicklable_part(obj, prefix)
        return part if part != prefix else f"{prefix} ({_exc(exc)})"


def _unpicklable_part(obj: Any, prefix: str) -> str:
    """Name the attribute, key or field of ``obj`` that does not pickle."""
    if isinstance(obj, Mapping):
        items = list(obj.items())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).items())
    else:
        return prefix
    for name, value in items:
        try:
            pickle.dumps(value)
        except Exception as exc:
            kind = "a lambda" if getattr(value, "__name__", "") == "<lambda>" else f"a {type(value).__module__}." \
                f"{type(value).__qualname__}"
            return f"{prefix}.{name} ({kind}: {_exc(exc)})"
    return prefix


def _exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
