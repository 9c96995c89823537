"""``TaskSet``: an agent tag's tasks, the one a seed picks. The members of a group share their
seed, so they share their task, as GRPO needs."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

from ragen.env import import_object
from ragen.errors import ConfigError, RagenError

_FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_JSON_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null"}


def is_function_path(source: str) -> bool:
    """Whether ``tasks`` names a function (``package.module:function``) rather than a file."""
    return bool(_FUNCTION_PATH.match(source))


class TaskError(RagenError, ValueError):
    """A tasks function gave something that is not a task (a dict that JSON can write)."""


class TaskSet:
    """The tasks of ``source``: the JSON objects of a JSONL file, a seed picking line ``seed %
    len``; or a function of the seed returning the task. ``task(seed)`` gives each call its own
    copy, so an episode that changes its task changes no other's. Build with ``TaskSet.load``."""

    def __init__(self, source: str, lines: list[str] | None = None,
                 function: Callable[[int], Any] | None = None) -> None:
        self.source = source
        self._lines = lines
        self._function = function

    @staticmethod
    def absolute(path: str) -> str:
        return os.path.abspath(os.path.expanduser(path))

    @classmethod
    def load(cls, source: str, where: str) -> TaskSet:
        """The tasks ``source`` names, checked; ``ConfigError`` naming ``where`` (the config key)."""
        if is_function_path(source):
            function = import_object(source, where, "package.module:function")
            if not callable(function):
                raise ConfigError(f"{where}: {source!r} is not callable, got {function!r}; name a function of the "
                                  "seed that returns the task as a dict")
            return cls(source, function=function)
        return cls(source, lines=_read_lines(source, where))

    def task(self, seed: int) -> dict[str, Any]:
        """The task of ``seed``: a fresh dict each call."""
        if self._lines is not None:
            return json.loads(self._lines[seed % len(self._lines)])
        task = self._function(seed)
        if not isinstance(task, dict):
            raise TaskError(f"tasks {self.source}({seed}) returned a {type(task).__name__}, not a dict: return "
                            "the task as a dict")
        try:
            json.dumps(task, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TaskError(f"tasks {self.source}({seed}) returned a task JSON cannot write ({exc}): a task "
                            "is sent to a command as JSON, and kept in the dump") from None
        return task


def _read_lines(path: str, where: str) -> list[str]:
    """The non-blank lines of the JSONL file ``path``, each checked to be a JSON object."""
    return [line for _, line, _ in json_objects(path, where, "a JSON object", "a JSONL file (one JSON object a line) "
                                                "or 'package.module:function' of the seed")]


def json_objects(path: str, where: str, task: str, file: str) -> list[tuple[int, str, dict[str, Any]]]:
    """Each non-blank line of the JSONL file ``path`` as (its number, its text, its JSON object); a
    ``ConfigError`` naming ``where`` for a file missing or unreadable (``file``: what to give
    instead), a line that is not JSON or not an object, or no line at all (``task``: what a line holds)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{where}: no file {path!r}; give {file}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read {path!r}: {exc}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{where}: {path} line {number} is not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {path} line {number} is {_JSON_KINDS.get(type(value), 'not an object')}, "
                              f"not a JSON object; write one task a line as {task}")
        rows.append((number, line, value))
    if not rows:
        raise ConfigError(f"{where}: {path} holds no task; write one task a line as {task}")
    return rows
