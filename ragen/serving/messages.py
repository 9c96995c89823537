"""The messages between workers and the shared manager, each carried in one frame (``wire``).

- Client -> manager: ``{"op": "open"|"close", "n": k, "tag": t}`` (streams
  opened under an announced tag, or closed), ``{"op": "call", "kind": k,
  "tag": t, "payload": p}`` (a call that the hooks announced with tag t
  answer: ``server.Hooks``), ``{"op": "gen", "ticket": t, "requests": [...],
  "sampling": {...}}``, or ``{"op": "cancel", "ticket": t}`` (the worker
  stopped waiting for t: a streaming engine drops it). Each is checked field
  by field on arrival (``parse_message``): a request of the wrong type or
  range, or with history ids outside the engine's vocabulary, is refused
  alone, never failing the engine call it would have joined. A ``close``,
  ``call`` or ``gen`` message may add ``"notes": {name: k}``: counts the
  worker gathered since its last message, for the hooks of its connection's
  tag. ``{"op": "batch", "msgs": [bytes, ...]}``: gen, close and cancel
  messages, each encoded as a frame's payload, that a worker held back to
  send together (env-level turns). A frame decodes to no more history ids or
  batched messages than its own bytes, and a frame past a bound is refused,
  naming it.
- Manager -> client: ``{"reply": p}`` (a call's reply; with ``"error": msg``
  when it could not be answered), or ``{"answers": [...]}``, one frame per
  connection and engine call (a streaming engine: per connection, the answers
  that finished since the last frame); each answer is ``{"ticket": t,
  "completions": [...]}`` (the answers' token ids and log-probs, not the
  prompts' token ids: those stay in the driver) or ``{"ticket": t, "error":
  msg}`` (with ``"timed_out": True`` when the engine did not answer within the
  manager's time limit, ``"unavailable": True`` when it can answer no request
  at all). A request that asked for its tokens as they are sampled
  (``stream_tokens``) gets, before its answer, partials in frames of their own:
  ``{"ticket": t, "index": i, "partial": ids}``, the ids the request at index i
  of the ticket's list sampled since its last partial (4 little-endian bytes an
  id); its completion still carries every id and log-prob (``read_partial``
  checks a partial where the client reads it).
"""

from __future__ import annotations

import logging
import math
import pickle
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from ragen.errors import RagenError
from ragen.llm.types import Completion, EngineUnavailable, GenerationRequest, SamplingParams, token_id_error
from ragen.serving import wire

logger = logging.getLogger(__name__)


def error_answer(ticket: int | None, exc: BaseException) -> dict[str, Any]:
    """The answer of a request list the engine failed on; ``unavailable`` when the
    engine can answer none (``EngineUnavailable``: the rollout stops)."""
    answer: dict[str, Any] = {"ticket": ticket, "error": f"{type(exc).__name__}: {exc}"}
    if isinstance(exc, EngineUnavailable):
        answer["unavailable"] = True
    return answer


MAX_NOTES = 16  # note names in one message
MAX_NAME_CHARS = 64  # of a call's kind and of a note's name


@dataclass(frozen=True)
class StreamsMessage:
    """A worker opens (``op="open"``, under ``tag``) or closes ``n`` streams."""

    op: str
    n: int
    tag: int | None
    notes: dict[str, int] = field(default_factory=dict)  # counts gathered since the worker's last message
    announced: bool = True  # opened streams count against the tag's announced ones (not a gateway call's)


@dataclass(frozen=True)
class CallMessage:
    """A worker's call of ``kind``, answered by the hooks announced with ``tag``."""

    kind: str
    tag: int | None
    payload: Any = None
    notes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GenMessage:
    """A worker asks for completions of ``requests`` under ``sampling``."""

    ticket: int
    requests: list[GenerationRequest]
    sampling: SamplingParams
    notes: dict[str, int] = field(default_factory=dict)
    sent: float | None = None  # the worker's time.monotonic() when it began encoding the message


@dataclass(frozen=True)
class CancelMessage:
    """A worker stopped waiting for ``ticket``: the engine may drop its requests."""

    ticket: int
    notes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchMessage:
    """Messages a worker held back to send in one frame: ``gen``, ``close`` and
    ``cancel`` messages, each parsed on its own (a malformed one is its ``BadMessage``)."""

    items: list[StreamsMessage | GenMessage | CancelMessage | BadMessage]
    notes: dict[str, int] = field(default_factory=dict)


MAX_BATCH = 1 << 16  # messages in one batch


class BadMessage(RagenError, ValueError):
    """A malformed message; ``ticket`` is its ticket where one could be read."""

    def __init__(self, message: str, ticket: int | None = None) -> None:
        super().__init__(message)
        self.ticket = ticket


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# What each field of a request and of its sampling params must be. Checked
# when a request arrives: a wrong type found by the engine would fail the
# whole coalesced call, other workers' requests with it.
_REQUEST_FIELDS = {
    "env_id": (_is_int, "an integer"),
    "turn": (_is_int, "an integer"),
    "seed": (_is_int, "an integer"),
    # 0 is an answer of no tokens (every engine handles it): a turn with no room left
    "max_tokens": (lambda v: v is None or (_is_int(v) and v >= 0), "null or an integer >= 0"),
    "last_turn": (lambda v: isinstance(v, bool), "true or false"),
    "answer_prefix": (lambda v: isinstance(v, str), "a string"),
    # decoded from bytes (request_for_wire), so every item is an integer >= 0
    "history_token_ids": (lambda v: v is None or isinstance(v, list), "null or 4 bytes an id"),
    "prompt_token_ids": (lambda v: v is None or isinstance(v, list), "null or 4 bytes an id"),
    "history_messages": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "tools": (lambda v: v is None or (isinstance(v, list) and all(isinstance(t, dict) for t in v)),
              "null or a list of objects"),
    "stream_tokens": (lambda v: isinstance(v, bool), "true or false"),
}
_ID_FIELDS = ("history_token_ids", "prompt_token_ids")  # token ids, which cross as bytes
_SAMPLING_FIELDS = {
    "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and v >= -1, "an integer >= -1 (-1: no top-k)"),
    "max_tokens": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "seed": (_is_int, "an integer"),
    "stop": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
}


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS


def _notes(msg: dict[str, Any]) -> dict[str, int]:
    notes = msg.get("notes", {})
    if not isinstance(notes, dict) or len(notes) > MAX_NOTES or not all(
            _is_name(k) and _is_int(v) and 0 <= v <= 1 << 24 for k, v in notes.items()):
        raise ValueError(f"'notes' must map at most {MAX_NOTES} names to non-negative integers, "
                         f"got {repr(notes)[:80]}")
    return notes


def _tag(msg: dict[str, Any]) -> int | None:
    tag = msg.get("tag")
    if tag is not None and not _is_int(tag):
        raise ValueError(f"'tag' must be an integer, got {tag!r}")
    return tag


def _check_fields(values: dict[str, Any], checks: dict[str, Any], where: str) -> None:
    for name, (ok, what) in checks.items():
        if not ok(values[name]):
            raise ValueError(f"{where}.{name} must be {what}, got {repr(values[name])[:80]}")


class _OverBound(RagenError, ValueError):
    """A frame whose content passes a bound of the whole frame: a batch holding it is refused whole."""


@dataclass
class _Room:
    """What the rest of a frame may carry (a batch's messages share it)."""

    requests: int


def parse_message(data: bytes, vocab_size: int | None = None
                  ) -> StreamsMessage | CallMessage | GenMessage | CancelMessage | BatchMessage:
    """A client's message, every field checked; BadMessage saying what is wrong otherwise.
    What the frame decodes to is bounded before it is built: at most ``MAX_REQUESTS``
    requests, and no more history bytes or batched messages than the frame holds (each
    must be bytes of its own, never one object named many times). ``vocab_size``: the
    engine's, which every history id must be within."""
    return _parse(data, vocab_size, _Room(wire.MAX_REQUESTS), in_batch=False)


def _parse(data: bytes, vocab_size: int | None, room: _Room, in_batch: bool
           ) -> StreamsMessage | CallMessage | GenMessage | CancelMessage | BatchMessage:
    ticket = None
    try:
        msg = wire.loads(data)
        if not isinstance(msg, dict):
            raise ValueError("a message must be a dict")
        op = msg.get("op")
        notes = _notes(msg)
        if op == "batch" and not in_batch:
            return _parse_batch(msg.get("msgs"), len(data), vocab_size, room, notes)
        if op in ("open", "close"):
            n = msg.get("n")
            if not _is_int(n) or not 0 <= n <= 1 << 16:
                raise ValueError(f"'n' must be a small non-negative integer, got {n!r}")
            announced = msg.get("announced", True)
            if not isinstance(announced, bool):
                raise ValueError(f"'announced' must be true or false, got {announced!r}")
            return StreamsMessage(op, n, _tag(msg), notes, announced)
        if op == "call":
            kind = msg.get("kind")
            if not _is_name(kind):
                raise ValueError(f"'kind' must be a name of at most {MAX_NAME_CHARS} characters, got "
                                 f"{repr(kind)[:80]}")
            return CallMessage(kind, _tag(msg), msg.get("payload"), notes)
        if op == "cancel":
            if not _is_int(msg.get("ticket")):
                raise ValueError("'ticket' must be an integer")
            return CancelMessage(msg["ticket"], notes)
        if op != "gen":
            raise ValueError(f"unknown op {repr(op)[:80]}")
        ticket = msg.get("ticket")
        if not _is_int(ticket):
            ticket = None
            raise ValueError("'ticket' must be an integer")
        requests = _gen_requests(msg.get("requests"), len(data), vocab_size, room)
        sampling_raw = msg.get("sampling") or {}
        if not isinstance(sampling_raw, dict):
            raise ValueError("'sampling' must be an object")
        sampling = SamplingParams.from_dict(sampling_raw)
        _check_fields(vars(sampling), _SAMPLING_FIELDS, "sampling")
        sent = msg.get("sent")
        return GenMessage(ticket, requests, sampling, notes, float(sent) if _is_number(sent) else None)
    except _OverBound as exc:
        if in_batch:
            raise
        raise BadMessage(str(exc), ticket) from None
    except (ValueError, TypeError) as exc:
        raise BadMessage(str(exc), ticket) from None


def _parse_batch(items: Any, size: int, vocab_size: int | None, room: _Room,
                 notes: dict[str, int]) -> BatchMessage:
    """A batch frame (of ``size`` bytes): each message parsed on its own; past
    ``MAX_REQUESTS`` in all, every message of the frame refused with that bound."""
    if not isinstance(items, list) or len(items) > MAX_BATCH or not all(isinstance(m, bytes) for m in items):
        raise ValueError(f"'msgs' must be a list of at most {MAX_BATCH} encoded messages")
    held = sum(len(m) for m in items)
    if held > size:
        raise ValueError(f"'msgs' total {held} bytes, more than the {size} bytes of the frame that holds them: "
                         "each message must be bytes of its own")
    parsed: list[StreamsMessage | GenMessage | CancelMessage | BadMessage] = []
    for item in items:
        try:
            one = _parse(item, vocab_size, room, in_batch=True)
            if isinstance(one, CallMessage):
                raise BadMessage("a call cannot be held in a batch: its reply is awaited")
            parsed.append(one)  # type: ignore[arg-type]
        except BadMessage as exc:
            parsed.append(exc)
        except _OverBound as exc:  # the frame's bound: what was parsed of it is dropped with the rest
            return BatchMessage([BadMessage(str(exc), _gen_ticket(m)) for m in items])
    return BatchMessage(parsed, notes)


def _gen_ticket(data: bytes) -> int | None:
    """The ticket of an encoded gen message, or None (another op, or not a message)."""
    try:
        msg = wire.loads(data)
    except ValueError:
        return None
    ticket = msg.get("ticket") if isinstance(msg, dict) and msg.get("op") == "gen" else None
    return ticket if _is_int(ticket) else None


def _gen_requests(raw: Any, size: int, vocab_size: int | None, room: _Room) -> list[GenerationRequest]:
    """The requests of a gen message of ``size`` bytes, each checked; ValueError naming the first bad field.
    Their number and the bytes of their histories are checked before any is built."""
    if not isinstance(raw, list):
        raise ValueError("'requests' must be a list of objects")
    room.requests -= len(raw)
    if room.requests < 0:
        raise _OverBound(f"a frame may carry at most {wire.MAX_REQUESTS} requests (ragen.serving.wire.MAX_REQUESTS); "
                         "this one carries more")
    if not all(isinstance(r, dict) for r in raw):
        raise ValueError("'requests' must be a list of objects")
    given = sum(len(h) for r in raw for name in _ID_FIELDS if isinstance(h := r.get(name), bytes))
    if given > size:
        raise ValueError(f"the requests' history and prompt ids total {given} bytes, more than the {size} bytes of "
                         "the message that carries them: each request's history_token_ids and prompt_token_ids "
                         "must be bytes of its own")
    requests = []
    for i, r in enumerate(raw):
        if any(name in r for name in _ID_FIELDS):  # a copy: the dict may be named by other requests too
            r = {**r, **{name: _ids_from_wire(r[name], f"requests[{i}].{name}") for name in _ID_FIELDS if name in r}}
        request = GenerationRequest.from_dict(r)
        _check_request(request, f"requests[{i}]", vocab_size)
        requests.append(request)
    return requests


def _check_request(r: GenerationRequest, where: str, vocab_size: int | None) -> None:
    """ValueError naming ``where`` and the field when a field of ``r`` is wrong."""
    if not isinstance(r.messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in r.messages
    ):
        raise ValueError(f"{where}.messages must be a list of {{role, content}} (strings)")
    _check_fields(vars(r), _REQUEST_FIELDS, where)
    if r.history_messages > len(r.messages):
        raise ValueError(f"{where}.history_messages must be at most its {len(r.messages)} messages, "
                         f"got {r.history_messages}")
    for name in _ID_FIELDS:
        ids = getattr(r, name)
        # max() first: the helper's checks of each id cost more, and these ids are ints >= 0 (4 bytes each)
        if vocab_size is not None and ids and max(ids) >= vocab_size:
            raise ValueError(f"{where} (env_id {r.env_id}, turn {r.turn}).{name}: {token_id_error(ids, vocab_size)}")


def ids_for_wire(ids: list[int]) -> bytes:
    """Token ids as 4 little-endian bytes an id (one string to pickle, not an int an id)."""
    packed = array("I", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def request_for_wire(request: GenerationRequest) -> dict[str, Any]:
    """A request as plain data for the manager: its history and prompt ids as bytes (4
    little-endian bytes an id), which pickle as one string where a list of ints pickles id by id."""
    d = request.to_dict()
    if not request.stream_tokens:
        del d["stream_tokens"]  # its default: a request that does not stream crosses as it always did
    for name in _ID_FIELDS:
        given = getattr(request, name)
        if given is not None:
            d[name] = ids_for_wire(given)
    return d


def _ids_from_wire(value: Any, where: str) -> list[int] | None:
    """Token ids from their bytes; ValueError naming ``where`` for anything else."""
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) % 4:
        raise ValueError(f"{where} must be null or 4 bytes an id, got {repr(value)[:80]}")
    ids = array("I")
    ids.frombytes(value)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def completion_for_wire(completion: Completion, request: GenerationRequest) -> dict[str, Any]:
    """A completion as plain data for the worker; TypeError if the engine answered something else."""
    if not isinstance(completion, Completion):
        raise TypeError(f"the engine returned {type(completion).__name__}, not a Completion, for the request "
                        f"of env_id {request.env_id}, turn {request.turn}")
    # The worker keeps the prompt's ids with its turn (the trainer trains them). A prompt that
    # starts with the request's given ids (its prompt ids, or the history it appends to) crosses
    # as the ids after them: the worker has those.
    d = completion.to_dict()
    given = request.prompt_token_ids if request.prompt_token_ids is not None else request.history_token_ids
    prompt = completion.prompt_token_ids
    if given and not completion.prompt_start and prompt[:len(given)] == given:
        d["prompt_token_ids"] = prompt[len(given):]
        d["prompt_start"] = len(given)
    return d


def completions_answer(ticket: int, transit_in: float | None, completions: list[Completion],
                       requests: list[GenerationRequest], engine_label: str | None = None) -> dict[str, Any]:
    """The answer of one request list with the engine's ``completions``; when one of them is
    not a ``Completion``, an error for that request list alone (the others' completions are
    good), which says the engine broke its contract where ``engine_label`` names it."""
    try:
        return {"ticket": ticket, "transit_in": transit_in,
                "completions": [completion_for_wire(c, r) for c, r in zip(completions, requests)]}
    except Exception as exc:  # whatever the engine's object fails with, only its request list fails
        logger.error("malformed completion from the %s: %s", engine_label or "engine", exc)
        error = f"{type(exc).__name__}: {exc}"
        return {"ticket": ticket, "error": error if engine_label is None else
                f"the {engine_label} broke its contract: {error}"}


def partials_frame(partials: list[tuple[int, int, list[int]]]) -> bytes:
    """The frame of one connection's partials, each ``(ticket, index, new ids)``."""
    return wire.frame({"answers": [{"ticket": t, "index": i, "partial": ids_for_wire(ids)} for t, i, ids in partials],
                       "sent": time.monotonic()})


def read_partial(answer: dict[str, Any]) -> tuple[int, int, list[int]]:
    """A partial as the client reads it: ``(ticket, index, new ids)``; ValueError naming the field
    at fault."""
    ticket, index = answer.get("ticket"), answer.get("index")
    if not _is_int(ticket):
        raise ValueError(f"a partial's 'ticket' must be an integer, got {repr(ticket)[:80]}")
    if not _is_int(index) or not 0 <= index < wire.MAX_REQUESTS:
        raise ValueError(f"a partial's 'index' must be an integer from 0 to {wire.MAX_REQUESTS - 1}, "
                         f"got {repr(index)[:80]}")
    ids = _ids_from_wire(answer["partial"], "a partial's 'partial'")
    if not ids:
        raise ValueError("a partial's 'partial' must be 4 bytes an id, at least one id")
    return ticket, index, ids


def answers_frame(answers: list[dict[str, Any]]) -> bytes:
    """The frame of one connection's answers. An answer that is not plain
    data (an engine's numpy number, say) becomes an error for its request
    list alone: encoded apart, only on this rare path."""
    sent = time.monotonic()
    try:
        return wire.frame({"answers": answers, "sent": sent})
    except pickle.PicklingError:
        pass
    checked = []
    for a in answers:
        try:
            wire.frame(a)
            checked.append(a)
            continue
        except pickle.PicklingError as exc:
            problem = exc
        for c in a.get("completions", []):
            try:
                wire.frame(c)
            except pickle.PicklingError as exc:
                problem = f"the completion for env_id {c.get('env_id')!r} (turn {c.get('turn')!r}): {exc}"
                break
        logger.error("malformed completion from the engine: %s", problem)
        checked.append({"ticket": a.get("ticket"), "error": f"the engine's answer cannot be sent: {problem}"})
    return wire.frame({"answers": checked, "sent": sent})
