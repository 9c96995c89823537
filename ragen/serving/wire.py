"""The wire between workers and the shared manager: frames, handshake, messages.

Frames are a 4-byte big-endian length and a pickle of plain data (dicts,
lists, strings, bytes, numbers), written by a pickler and read by an
unpickler that refuse every class and function: a frame carries nothing but
data (as safe as JSON, and cheaper to encode and decode, which matters
because the full message history of every env travels each turn). Each side
refuses a frame longer than its ``max_message_bytes`` (and closes the
connection: the stream is out of step), so a sender checks its own message
against that limit before it sends (``send_frame``, ``MessageTooLarge``).
What a frame decodes to is bounded too (pickle can name one object many
times): at most ``MAX_REQUESTS`` requests, and no more history ids or batched
messages than the frame's own bytes; a frame past a bound is refused, naming it.

- Handshake, within one deadline in all: manager -> client ``b"RAGEN4"`` and a
  32-byte nonce; client -> manager ``HMAC-SHA256(key, b"ragen client" + that
  nonce)`` and a 32-byte nonce of its own; the manager checks the HMAC (a wrong
  one closes the connection), then sends the frame ``{"ok": True, "proof":
  HMAC-SHA256(key, b"ragen server" + the client's nonce)}``, which the client
  checks before it sends anything. Nothing else is read before the key is
  proven, and a worker never takes answers from a server that lacks the key.
- Client -> manager: ``{"op": "open"|"close", "n": k, "tag": t}`` (streams
  opened under an announced tag, or closed), ``{"op": "call", "kind": k,
  "tag": t, "payload": p}`` (a call that the hooks announced with tag t
  answer: ``server.Hooks``), or ``{"op": "gen", "ticket": t, "requests":
  [...], "sampling": {...}}``, checked field by field on arrival
  (``parse_message``): a request of the wrong type or range, or with history
  ids outside the engine's vocabulary, is refused alone, never failing the
  engine call it would have joined. A ``close``,
  ``call`` or ``gen`` message may add ``"notes": {name: k}``: counts the
  worker gathered since its last message, for the hooks of its connection's
  tag (absent means none). ``{"op": "batch", "msgs": [bytes, ...]}``: gen
  and close messages, each encoded as a frame's payload, that a worker held
  back to send together (env-level turns: one frame for the requests that
  became ready together, not one a request). ``{"op": "cancel", "ticket":
  t}``: the worker stopped waiting for t (a streaming engine drops it).
- Manager -> client: ``{"reply": p}`` (a call's reply; with ``"error": msg``
  when it could not be answered), or ``{"answers": [...]}``, one frame per
  connection and engine call (a streaming engine: per connection, the
  answers that finished since the last frame); each answer is ``{"ticket": t, "completions":
  [...]}`` (the answers' token ids and log-probs, not the prompts' token ids:
  those stay in the driver) or ``{"ticket": t, "error": msg}`` (with
  ``"timed_out": True`` when the engine did not answer within the manager's
  time limit, ``"unavailable": True`` when it can answer no request at all).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import math
import pickle
import secrets
import socket
import struct
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from ragen.llm.types import Completion, EngineUnavailable, GenerationRequest, SamplingParams, token_id_error

logger = logging.getLogger(__name__)

MAGIC = b"RAGEN4"  # the protocol's version: a manager and a client of different versions refuse each other
NONCE_BYTES = 32
DIGEST_BYTES = hashlib.sha256().digest_size
# Each side proves the key over its own label, so what one side answers can
# never be replayed as the other's proof.
CLIENT_LABEL, SERVER_LABEL = b"ragen client", b"ragen server"
_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size  # a frame's length prefix


def error_answer(ticket: int | None, exc: BaseException) -> dict[str, Any]:
    """The answer of a request list the engine failed on; ``unavailable`` when the
    engine can answer none (``EngineUnavailable``: the rollout stops)."""
    answer: dict[str, Any] = {"ticket": ticket, "error": f"{type(exc).__name__}: {exc}"}
    if isinstance(exc, EngineUnavailable):
        answer["unavailable"] = True
    return answer


class ProtocolError(RuntimeError):
    """A frame or reply broke the protocol (too long, not a reply)."""


class AuthenticationError(ConnectionError):
    """The peer could not prove it holds the manager's key."""


class MessageTooLarge(ProtocolError):
    """A message was not sent: its frame is longer than the peer reads
    (``agent_proxy.max_message_bytes``). The connection is left intact.
    ``refused``: the indices of the requests to drop so that the rest fit
    (a gen message; the largest first)."""

    def __init__(self, size: int, limit: int, refused: list[int] | None = None,
                 request_sizes: dict[int, int] | None = None) -> None:
        super().__init__(f"a message of {size} bytes exceeds the limit of {limit} bytes "
                         f"(agent_proxy.max_message_bytes)")
        self.size, self.limit = size, limit
        self.refused = refused or []
        self.request_sizes = request_sizes or {}


# ----- frames -------------------------------------------------------------------

def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; with a ``deadline`` (time.monotonic()), TimeoutError once it
    passes, however the bytes trickle in (a timeout per recv would let one
    byte every few seconds hold a connection open for ever)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(buf)} of {n} bytes before the deadline")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a frame may hold only plain data, not {module}.{name}")


def loads(data: bytes) -> Any:
    """Plain data from a frame; ValueError for anything else."""
    try:
        return _DataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # truncated or foreign bytes fail in many ways
        raise ValueError(f"not a frame of plain data ({type(exc).__name__}: {exc})") from None


class _DataPickler(pickle.Pickler):
    # Called only for objects that are not of a builtin type (str, int, dict,
    # list...): refusing them here costs nothing on plain data, and an engine's
    # numpy float or str subclass fails in the manager, where the request it
    # answers is known, not in the worker's unpickler.
    def reducer_override(self, obj: Any) -> Any:
        raise pickle.PicklingError(f"a frame may hold only plain data, not {type(obj).__module__}."
                                   f"{type(obj).__qualname__}")


def frame(obj: Any) -> bytes:
    """A frame of plain data; pickle.PicklingError for anything else."""
    buf = io.BytesIO()
    buf.write(b"\0" * _HEADER.size)
    _DataPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    view = buf.getbuffer()
    _HEADER.pack_into(view, 0, len(view) - _HEADER.size)
    del view
    return buf.getvalue()


def send_frame(sock: socket.socket, obj: Any, max_bytes: int | None = None) -> int:
    """Sends ``obj`` as one frame; MessageTooLarge, before a byte is sent,
    when its payload is longer than ``max_bytes`` (the peer would close the
    connection on reading its length)."""
    data = frame(obj)
    if max_bytes is not None and len(data) - _HEADER.size > max_bytes:
        raise MessageTooLarge(len(data) - _HEADER.size, max_bytes)
    sock.sendall(data)
    return len(data)


def recv_frame(sock: socket.socket, max_bytes: int, deadline: float | None = None) -> tuple[bytes, int]:
    """A frame's payload and the bytes it took; ProtocolError when it is longer than ``max_bytes``."""
    (n,) = _HEADER.unpack(recv_exact(sock, _HEADER.size, deadline))
    if n > max_bytes:
        raise ProtocolError(f"frame of {n} bytes exceeds the limit of {max_bytes}")
    return recv_exact(sock, n, deadline), n + _HEADER.size


# ----- handshake ----------------------------------------------------------------

def _digest(key: bytes, label: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, label + nonce, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, key: bytes, timeout_s: float) -> None:
    """The manager's side, within ``timeout_s`` in all: AuthenticationError for
    a wrong key, TimeoutError when the peer is too slow."""
    deadline = time.monotonic() + timeout_s
    sock.settimeout(timeout_s)
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + nonce)
    answer = recv_exact(sock, DIGEST_BYTES, deadline)
    if not hmac.compare_digest(answer, _digest(key, CLIENT_LABEL, nonce)):
        raise AuthenticationError("wrong key")
    client_nonce = recv_exact(sock, NONCE_BYTES, deadline)
    sock.settimeout(max(1e-3, deadline - time.monotonic()))
    send_frame(sock, {"ok": True, "proof": _digest(key, SERVER_LABEL, client_nonce)})
    sock.settimeout(None)


def client_handshake(sock: socket.socket, key: bytes, address: Any, timeout_s: float) -> None:
    """The worker's side: it proves the key over the manager's nonce, the
    manager over the worker's (a server that does not know the key must not
    feed workers answers)."""
    deadline = time.monotonic() + timeout_s
    hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if not hello.startswith(MAGIC):
        raise ProtocolError(f"{address} is not a ragen LLM manager (of this version)")
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(_digest(key, CLIENT_LABEL, hello[len(MAGIC):]) + nonce)
    try:
        data, _ = recv_frame(sock, 1 << 10, deadline)
    except (EOFError, ConnectionResetError):  # reset: it closed before reading our nonce
        raise ConnectionRefusedError(f"the LLM manager at {address} refused the key") from None
    reply = loads(data)
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise ConnectionRefusedError(f"the LLM manager at {address} refused the connection")
    proof = reply.get("proof")
    if not isinstance(proof, bytes) or not hmac.compare_digest(proof, _digest(key, SERVER_LABEL, nonce)):
        raise AuthenticationError(
            f"the server at {address} did not prove it holds the key of this client's LLM manager: "
            "it is not that manager (a stale address, or another process on its port); refusing it")


# ----- messages -----------------------------------------------------------------

MAX_NOTES = 16  # note names in one message
MAX_NAME_CHARS = 64  # of a call's kind and of a note's name


@dataclass(frozen=True)
class StreamsMessage:
    """A worker opens (``op="open"``, under ``tag``) or closes ``n`` streams."""

    op: str
    n: int
    tag: int | None
    notes: dict[str, int] = field(default_factory=dict)  # counts gathered since the worker's last message


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
    """Messages a worker held back to send in one frame: ``gen`` and ``close``
    messages, each parsed on its own (a malformed one is its ``BadMessage``)."""

    items: list[StreamsMessage | GenMessage | CancelMessage | BadMessage]
    notes: dict[str, int] = field(default_factory=dict)


MAX_BATCH = 1 << 16  # messages in one batch
# Requests in one frame (a batch's messages together). A frame's length bounds
# its bytes, not the objects it decodes to: pickle can name one request (or one
# history) many times, and each request costs the manager objects many times
# its size on the wire. An honest worker sends one request an env.
MAX_REQUESTS = 1 << 14


class BadMessage(ValueError):
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
    "history_messages": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
}
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


class _OverBound(ValueError):
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
    return _parse(data, vocab_size, _Room(MAX_REQUESTS), in_batch=False)


def _parse(data: bytes, vocab_size: int | None, room: _Room, in_batch: bool
           ) -> StreamsMessage | CallMessage | GenMessage | CancelMessage | BatchMessage:
    ticket = None
    try:
        msg = loads(data)
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
            return StreamsMessage(op, n, _tag(msg), notes)
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
        msg = loads(data)
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
        raise _OverBound(f"a frame may carry at most {MAX_REQUESTS} requests (ragen.serving.wire.MAX_REQUESTS); "
                         "this one carries more")
    if not all(isinstance(r, dict) for r in raw):
        raise ValueError("'requests' must be a list of objects")
    history = sum(len(h) for r in raw if isinstance(h := r.get("history_token_ids"), bytes))
    if history > size:
        raise ValueError(f"the requests' history ids total {history} bytes, more than the {size} bytes of the "
                         "message that carries them: each request's history_token_ids must be bytes of its own")
    requests = []
    for i, r in enumerate(raw):
        if "history_token_ids" in r:  # a copy: the dict may be named by other requests too
            r = {**r, "history_token_ids": _history_from_wire(r["history_token_ids"], f"requests[{i}]")}
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
    ids = r.history_token_ids
    # max() first: the helper's checks of each id cost more, and these ids are ints >= 0 (4 bytes each)
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        raise ValueError(f"{where} (env_id {r.env_id}, turn {r.turn}).history_token_ids: "
                         f"{token_id_error(ids, vocab_size)}")


def request_for_wire(request: GenerationRequest) -> dict[str, Any]:
    """A request as plain data for the manager: its history ids as bytes (4 little-endian
    bytes an id), which pickle as one string where a list of ints pickles id by id."""
    d = request.to_dict()
    if request.history_token_ids is not None:
        ids = array("I", request.history_token_ids)
        if sys.byteorder == "big":
            ids.byteswap()
        d["history_token_ids"] = ids.tobytes()
    return d


def _history_from_wire(value: Any, where: str) -> list[int] | None:
    """A request's history ids from their bytes; ValueError naming ``where`` for anything else."""
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) % 4:
        raise ValueError(f"{where}.history_token_ids must be null or 4 bytes an id, got {repr(value)[:80]}")
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
    # appends to the request's history ids crosses as the ids after them: the worker has those.
    d = completion.to_dict()
    history = request.history_token_ids
    prompt = completion.prompt_token_ids
    if history and not completion.prompt_start and prompt[:len(history)] == history:
        d["prompt_token_ids"] = prompt[len(history):]
        d["prompt_start"] = len(history)
    return d


def answers_frame(answers: list[dict[str, Any]]) -> bytes:
    """The frame of one connection's answers. An answer that is not plain
    data (an engine's numpy number, say) becomes an error for its request
    list alone: encoded apart, only on this rare path."""
    sent = time.monotonic()
    try:
        return frame({"answers": answers, "sent": sent})
    except pickle.PicklingError:
        pass
    checked = []
    for a in answers:
        try:
            frame(a)
            checked.append(a)
            continue
        except pickle.PicklingError as exc:
            problem = exc
        for c in a.get("completions", []):
            try:
                frame(c)
            except pickle.PicklingError as exc:
                problem = f"the completion for env_id {c.get('env_id')!r} (turn {c.get('turn')!r}): {exc}"
                break
        logger.error("malformed completion from the engine: %s", problem)
        checked.append({"ticket": a.get("ticket"), "error": f"the engine's answer cannot be sent: {problem}"})
    return frame({"answers": checked, "sent": sent})
