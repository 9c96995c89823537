"""A tool's ``parameters`` schema: what a config may declare, and the validator a call is checked with.

- ``check_parameters(parameters, at)``: at config read, ValueError naming ``at`` and the place in
  the schema when it is not valid JSON Schema, or when checking a call against it could not be
  bounded: a ``$ref`` that is not a JSON pointer into the parameters themselves (``#/$defs/item``:
  nothing is downloaded), references that recurse (``#`` within itself), a schema past
  ``MAX_SCHEMA_NODES`` once its references are expanded, a ``$id`` below the root (it moves
  where ``#/...`` points), ``$dynamicRef``/``$recursiveRef``, ``patternProperties`` (its patterns
  would run on every key a model writes, outside the budget), or a ``pattern`` the ``regex``
  engine cannot compile.
- ``validator(parameters)``: the validator of one tool's parameters (their JSON text). It resolves
  no reference outside them (an empty registry: a remote ``$ref`` fails, it is never fetched) and
  runs each ``pattern`` with ``regex`` instead of ``re``, under the time left in the current
  ``pattern_budget()`` (``PATTERN_BUDGET_S`` of CPU time per answer; ``regex`` counts its timeout
  in the process's CPU time, so other busy threads end a search sooner, never later, and on a
  loaded machine the wall time is longer). ``regex`` stops a
  search at its timeout and releases the GIL while it searches, so a pattern that backtracks
  exponentially (``^(a|aa)+$``) costs one answer the budget, and other threads run meanwhile:
  past the budget, a search raises ``PatternTimeout``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import re
import time
from typing import Any, Iterator, Mapping
from urllib.parse import unquote

import jsonschema
import referencing
import regex

from ragen.errors import RagenError

MAX_SCHEMA_NODES = 10_000  # schema objects once references are expanded: a tool's is tens
PATTERN_BUDGET_S = 0.25  # CPU seconds: the pattern searches of one answer's calls, in all
_POINTER = re.compile(r"#(/.*)?", re.DOTALL)
_DATA = frozenset({"enum", "const", "default", "examples"})  # values, not schemas
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"})
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("ragen_pattern_deadline", default=None)


class PatternTimeout(RagenError):
    """A ``pattern`` search that did not end within the answer's pattern budget."""

    def __init__(self, pattern: str) -> None:
        super().__init__(f"the pattern {pattern!r:.80} took more than the {PATTERN_BUDGET_S} s of CPU time its answer "
                         "may spend on patterns")
        self.pattern = pattern


def check_parameters(parameters: Mapping[str, Any], at: str) -> None:
    """ValueError naming ``at`` and the place in the schema when ``parameters`` may not be a tool's
    parameters (see the module docstring)."""
    cls = jsonschema.validators.validator_for(parameters)
    try:
        cls.check_schema(parameters)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"{at} is not valid JSON Schema at {_where(exc.path)}: {exc.message}") from None
    id_keys = ("$id", "id") if cls in (jsonschema.Draft3Validator, jsonschema.Draft4Validator) else ("$id",)
    for path, node in _schemas(parameters, ()):
        if not isinstance(node, Mapping):
            continue
        for key in ("$dynamicRef", "$recursiveRef", "patternProperties"):
            if key in node:
                raise ValueError(f"{at} at {_where(path)}: {key} is not taken in tool parameters ("
                                 + ("its patterns would run on every key a model writes, unbounded; name the "
                                    "properties, or bound the keys with propertyNames: {pattern: ...})"
                                    if key == "patternProperties" else "it refers recursively)"))
        if path and any(isinstance(node.get(key), str) for key in id_keys):
            raise ValueError(f"{at} at {_where(path)}: an {'/'.join(id_keys)} below the root is not taken in tool "
                             "parameters (it moves where #/... points); refer with JSON pointers from the root")
        if "$ref" in node:
            _target(parameters, node["$ref"], f"{at} at {_where(path)}")
        if isinstance(node.get("pattern"), str):
            try:
                regex.compile(node["pattern"])
            except regex.error as exc:
                raise ValueError(f"{at} at {_where(path)}/pattern: {node['pattern']!r:.80} is not a pattern the "
                                 f"regex engine reads: {exc}") from None
    _expanded_size(parameters, (), at, {}, set())


def _where(path: Any) -> str:
    return "/".join(str(p) for p in path) or "(root)"


def _schemas(schema: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
    """Every schema within ``schema`` with its path: the values of keywords, and of the names of
    ``properties``, ``$defs`` and the like; never ``enum``, ``const``, ``default`` or ``examples``
    (data). A keyword this does not know is walked as a schema: a reference there is checked too."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            yield from _schemas(sub, (*path, i))
        return
    if isinstance(schema, bool):  # true / false: a schema with nothing within
        yield path, schema
    if not isinstance(schema, Mapping):
        return
    yield path, schema
    for key, value in schema.items():
        if key in _DATA:
            continue
        if key in _NAMED and isinstance(value, Mapping):
            for name, sub in value.items():
                yield from _schemas(sub, (*path, key, name))
        elif isinstance(value, (Mapping, list)):
            yield from _schemas(value, (*path, key))


def _target(root: Any, ref: Any, at: str) -> tuple:
    """The path that ``$ref`` ``ref`` points to in ``root``; ValueError naming ``at`` when it is not a
    JSON pointer into ``root`` (a URL, a file, an anchor) or points at nothing."""
    match = _POINTER.fullmatch(ref) if isinstance(ref, str) else None
    if match is None:
        raise ValueError(f"{at}: $ref {ref!r:.80} is not taken: a tool's parameters refer only into themselves, by "
                         "a JSON pointer (#/$defs/name); nothing is downloaded at run time")
    path: list[Any] = []
    node = root
    for part in (unquote(match.group(1) or "").split("/")[1:]):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            path.append(int(part))
            node = node[int(part)]
        elif isinstance(node, Mapping) and part in node:
            path.append(part)
            node = node[part]
        else:
            raise ValueError(f"{at}: $ref {ref!r:.80} points at nothing in the parameters")
    return tuple(path)


def _expanded_size(root: Any, path: tuple, at: str, sizes: dict[tuple, int], open_: set[tuple]) -> int:
    """The schema objects a validator may walk from ``path``, each reference expanded (memoized in
    ``sizes``); ValueError naming ``at`` when a reference leads back into a schema it is within
    (``open_``: the references being expanded) or the count passes ``MAX_SCHEMA_NODES``."""
    if path in sizes:
        return sizes[path]
    node = root
    for part in path:
        node = node[part]
    open_.add(path)
    size = 0
    for where, sub in _schemas(node, path):
        size += 1
        if isinstance(sub, Mapping) and "$ref" in sub:
            target = _target(root, sub["$ref"], at)
            if target in open_:
                raise ValueError(f"{at} at {_where(where)}: $ref {sub['$ref']!r} refers back into a schema it is "
                                 "within, so checking a call would recurse without end; tool parameters must "
                                 "be a finite tree (write the nesting out to the depth a call needs)")
            size += _expanded_size(root, target, at, sizes, open_)
        if size > MAX_SCHEMA_NODES:
            raise ValueError(f"{at}: the parameters expand to more than {MAX_SCHEMA_NODES} schemas once their "
                             "$refs are followed, which every call would be checked against")
    open_.discard(path)
    sizes[path] = size
    return size


@contextlib.contextmanager
def pattern_budget() -> Iterator[None]:
    """The pattern searches within share ``PATTERN_BUDGET_S`` of this thread's CPU time (nested: the outer one's)."""
    if _DEADLINE.get() is not None:
        yield
        return
    token = _DEADLINE.set(time.thread_time() + PATTERN_BUDGET_S)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    """jsonschema's ``pattern`` keyword, searched with ``regex`` within the budget."""
    if not validator.is_type(instance, "string"):
        return
    deadline = _DEADLINE.get()
    left = PATTERN_BUDGET_S if deadline is None else deadline - time.thread_time()
    if left <= 0:
        raise PatternTimeout(pattern)
    try:
        found = regex.search(pattern, instance, timeout=left)
    except TimeoutError:
        raise PatternTimeout(pattern) from None
    if found is None:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


@functools.lru_cache(maxsize=None)
def _bounded(cls: type) -> type:
    """``cls`` (a draft's validator class) with the budgeted ``pattern``."""
    return jsonschema.validators.extend(cls, {"pattern": _pattern})


@functools.lru_cache(maxsize=256)
def validator(parameters: str) -> Any:
    """A validator of one tool's parameters (their JSON text: a key that hashes), built once."""
    schema = json.loads(parameters)
    return _bounded(jsonschema.validators.validator_for(schema))(schema, registry=referencing.Registry())
