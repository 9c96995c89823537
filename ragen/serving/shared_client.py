"""``SharedLLMClient``: a worker's handle on the driver's ``SharedLLMInferenceManager``.

It is small and picklable (address, key and the tag it works under), and each
process and thread opens its own connection on first use. Besides generating
(the ``Transport`` protocol), it makes ``call``s that the hooks announced with
its tag answer, and gathers ``note`` counts that ride on its next message
(``server.Hooks``). Held messages (env-level turns) share frames. A request
list submitted with ``on_tokens`` asks for its ids as they are sampled: the
manager's partials for its ticket reach that callback, on the thread that
waits (``wait_any``), before the ticket's answer is returned.
"""

from __future__ import annotations

import dataclasses
import os
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ragen.llm.types import Completion, EngineError, GenerationRequest, SamplingParams
from ragen.serving import messages, wire

_CONNECT_TIMEOUT_S = 30.0
_CONNECT_TRIES = 3
# Held messages (env-level turns) go out at most one frame per HOLD_S: the
# first after a quiet spell at once, the others of a burst together once the
# oldest waited HOLD_S (or when the worker waits). A worker's frames follow
# time and the engine's answers, not envs x turns.
HOLD_S = 0.002

_LOCAL = threading.local()


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether ``sock`` has something to read (or its end) within ``timeout_s``. poll, not select:
    select fails on a descriptor numbered past 1024, which a process with many connections reaches
    (a worker whose gateway serves an agent that floods its session)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000.0))


@dataclass(frozen=True)
class SharedLLMClient:
    """Picklable handle on a manager; connections are per process and thread."""

    address: tuple[str, int]
    authkey: bytes = field(repr=False)
    timeout_s: float | None = None  # for one answer; None: wait as long as it takes
    tag: int | None = None  # the announced tag its streams are opened and its calls made under
    # the largest frame it reads, as the manager caps what it reads
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    streams: bool = False  # the manager's engine answers each request as soon as it is done

    def _key(self) -> tuple:
        """This process's connection to this manager (a forked child opens its own)."""
        return (os.getpid(), tuple(self.address), self.authkey)

    def _state(self) -> dict[str, Any]:
        cache = getattr(_LOCAL, "conns", None)
        if cache is None:
            cache = _LOCAL.conns = {}
        key = self._key()
        state = cache.get(key)
        if state is None:
            # transit: seconds its messages spent on the wire, summed, and how many (transit())
            # held: messages kept back to share a frame (submit(hold=True)), sent by flush()
            # on_tokens: by ticket, the callback of a request list that asked for its ids as sampled
            state = {"sock": self._connect(), "ticket": 0, "outstanding": set(), "inbox": deque(), "notes": {},
                     "transit": [0.0, 0], "held": [], "held_since": 0.0, "flushed_at": 0.0, "on_tokens": {}}
            cache[key] = state
        return state

    def _connect(self) -> socket.socket:
        # A manager full of peers that never finish their handshake closes the
        # oldest of them: a worker's connection is one only if many peers came
        # after it within its handshake, so a few tries get it through.
        for attempt in range(_CONNECT_TRIES):
            sock = socket.create_connection(tuple(self.address), timeout=_CONNECT_TIMEOUT_S)
            try:
                wire.client_handshake(sock, self.authkey, self.address, _CONNECT_TIMEOUT_S)
                break
            except TimeoutError:
                sock.close()
                raise TimeoutError(f"no handshake from the LLM manager at {self.address} within "
                                   f"{_CONNECT_TIMEOUT_S} s") from None
            except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError, EOFError):
                sock.close()
                if attempt + 1 == _CONNECT_TRIES:
                    raise
            except BaseException:  # whatever ends the handshake, the socket is closed
                sock.close()
                raise
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def reset(self) -> None:
        """Drop this thread's connection (after a failure, answers may be stale)."""
        cache = getattr(_LOCAL, "conns", {})
        state = cache.pop(self._key(), None)
        if state is not None:
            state["sock"].close()

    def drop_if_closed(self) -> None:
        """Drop this thread's connection if the manager has closed it, so that
        the next message goes over a fresh one (new work never starts on a
        dead connection)."""
        state = getattr(_LOCAL, "conns", {}).get(self._key())
        if state is None:
            return
        try:
            closed = state["sock"].recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            closed = False  # open, nothing to read
        except OSError:
            closed = True
        if closed:
            self.reset()

    def open_streams(self, n: int, announced: bool = True) -> None:
        """``n`` streams open under the client's tag; ``announced``: counted against the streams the
        rollout announced (its chunks), not for a gateway call, which the announcement does not hold."""
        msg: dict[str, Any] = {"op": "open", "n": n, "tag": self.tag}
        if not announced:
            msg["announced"] = False
        state = self._state()
        wire.send_frame(state["sock"], self._with_notes(state, msg))

    def send_notes(self) -> None:
        """The counts noted so far, sent now in a message of their own (a thread that sends nothing else)."""
        if self._state()["notes"]:
            self.open_streams(0, announced=False)

    def close_stream(self, hold: bool = False) -> None:
        state = self._state()
        if hold or state["held"]:  # after the held requests of its stream, never before them
            self._hold(state, wire.frame({"op": "close", "n": 1})[wire.HEADER_BYTES:])
            return
        wire.send_frame(state["sock"], self._with_notes(state, {"op": "close", "n": 1}))

    def _hold(self, state: dict[str, Any], msg: bytes, requests: int = 0) -> None:
        """``msg`` (an encoded message of ``requests`` requests) kept back to share a frame:
        sent at once when no frame went out in the last ``HOLD_S``, else with the messages
        after it, once the oldest waited ``HOLD_S`` (or at the next wait)."""
        now = time.monotonic()
        if not state["held"]:
            state["held_since"] = now
        state["held"].append((msg, requests))
        if now - state["held_since"] >= HOLD_S or now - state["flushed_at"] >= HOLD_S:
            self.flush()

    def flush(self) -> None:
        """Sends the held messages, as few frames as the manager reads (its message
        limit, ``messages.MAX_BATCH`` messages, ``wire.MAX_REQUESTS`` requests) in
        ``{"op": "batch", "msgs": [encoded message, ...]}`` (each encoded once,
        when it was held); the notes ride on the first."""
        state = getattr(_LOCAL, "conns", {}).get(self._key())
        if state is None or not state["held"]:
            return
        held, state["held"] = state["held"], []
        state["flushed_at"] = time.monotonic()
        frames: list[list[bytes]] = [[]]
        size = requests = 0
        for msg, n in held:
            full = (size + len(msg) > self.max_message_bytes - 4096  # room for the batch's own fields
                    or len(frames[-1]) == messages.MAX_BATCH or requests + n > wire.MAX_REQUESTS)
            if frames[-1] and full:
                frames.append([])
                size = requests = 0
            frames[-1].append(msg)
            size += len(msg) + 8
            requests += n
        for i, msgs in enumerate(frames):
            batch = {"op": "batch", "msgs": msgs, "sent": time.monotonic()}
            wire.send_frame(state["sock"], self._with_notes(state, batch) if i == 0 else batch)

    def note(self, name: str, n: int) -> None:
        """Adds ``n`` to the count ``name``, sent with the next message (a
        request, a call or a stream's close): no message of its own."""
        notes = self._state()["notes"]
        notes[name] = notes.get(name, 0) + n

    @staticmethod
    def _with_notes(state: dict[str, Any], msg: dict[str, Any]) -> dict[str, Any]:
        if state["notes"]:
            msg["notes"], state["notes"] = state["notes"], {}
        return msg

    def submit(self, requests: list[GenerationRequest], sampling: SamplingParams, hold: bool = False,
               on_tokens: Callable[[int, list[int]], None] | None = None) -> int:
        """The requests' ticket; ``wire.MessageTooLarge`` naming the requests to
        leave out (the largest first) when their message is longer than the
        manager reads: nothing is sent then, and the connection goes on.
        ``hold``: kept back, for at most ``HOLD_S``, to share a frame with the
        messages after it. ``on_tokens(index, ids)``: the requests stream their ids
        (``stream_tokens``), each new part told with the request's index in
        ``requests`` while ``wait_any`` waits, before the ticket's answer."""
        state = self._state()
        if on_tokens is not None:
            requests = [r if r.stream_tokens else dataclasses.replace(r, stream_tokens=True) for r in requests]
        ticket = self._send_gen(state, requests, sampling, hold)
        if on_tokens is not None:
            state["on_tokens"][ticket] = on_tokens
        return ticket

    def _send_gen(self, state: dict[str, Any], requests: list[GenerationRequest], sampling: SamplingParams,
                  hold: bool) -> int:
        raw = [messages.request_for_wire(r) for r in requests]
        msg = {"op": "gen", "ticket": state["ticket"] + 1, "sent": time.monotonic(), "requests": raw,
               "sampling": sampling.to_dict()}
        if hold:
            data = wire.frame(msg)[wire.HEADER_BYTES:]
            if len(data) > self.max_message_bytes - 4096:  # it must fit a batch frame
                self._refuse(raw, wire.MessageTooLarge(len(data) + 4096, self.max_message_bytes))
            state["ticket"] += 1
            state["outstanding"].add(state["ticket"])
            self._hold(state, data, len(requests))
            return state["ticket"]
        if state["notes"]:
            msg["notes"] = state["notes"]
        try:
            wire.send_frame(state["sock"], msg, self.max_message_bytes)
        except wire.MessageTooLarge as exc:
            self._refuse(raw, exc)
        state["notes"] = {}
        state["ticket"] += 1
        state["outstanding"].add(state["ticket"])
        return state["ticket"]

    @staticmethod
    def _refuse(raw: list[dict[str, Any]], exc: wire.MessageTooLarge) -> None:
        """``wire.MessageTooLarge`` naming the requests to leave out, the largest first, until the rest fit."""
        sizes = {i: len(wire.frame(r)) for i, r in enumerate(raw)}
        left, refused = exc.size, []
        for i in sorted(sizes, key=sizes.__getitem__, reverse=True):
            if left <= exc.limit:
                break
            refused.append(i)
            left -= sizes[i]
        raise wire.MessageTooLarge(exc.size, exc.limit, refused, sizes) from None

    def ready(self) -> bool:
        state = self._state()
        if state["held"] and time.monotonic() - state["held_since"] >= HOLD_S:
            self.flush()
        if state["inbox"]:
            return True
        return _readable(state["sock"], 0.0)

    def transit(self) -> tuple[float, int]:
        """Seconds this thread's messages spent on the wire (encoding, sending,
        waking the reader, decoding), summed, and how many: each request from
        its send to its arrival, each reply from its encoding to its decoding
        when this thread was already waiting for it (a reply that waited for
        a busy worker was not slowed by the wire). Only on the manager's
        machine (one monotonic clock)."""
        state = getattr(_LOCAL, "conns", {}).get(self._key())
        if state is None:  # not connected (yet, or any more after a failure): nothing to read, nothing opened
            return 0.0, 0
        seconds, n = state["transit"]
        return seconds, n

    def call(self, kind: str, payload: Any = None) -> Any:
        """The reply of the handler of ``kind`` announced with this client's
        tag (plain data both ways); None once the tag is withdrawn.
        ``wire.ProtocolError`` when the manager could not answer it. Answers
        that arrive meanwhile wait in the inbox for ``wait_any``."""
        state = self._state()
        msg = {"op": "call", "kind": kind, "tag": self.tag, "payload": payload}
        wire.send_frame(state["sock"], self._with_notes(state, msg), self.max_message_bytes)
        while True:
            reply = self._read_reply(state)
            if "reply" in reply:
                if reply.get("error") is not None:
                    raise wire.ProtocolError(f"the LLM manager at {self.address} did not answer the call "
                                             f"{kind!r}: {reply['error']}")
                return reply["reply"]
            state["inbox"].extend(reply["answers"])

    @staticmethod
    def _add_transit(state: dict[str, Any], seconds: float) -> None:
        if 0.0 <= seconds < 60.0:  # else not one clock (a worker on another machine)
            state["transit"][0] += seconds
            state["transit"][1] += 1

    def _read_reply(self, state: dict[str, Any]) -> dict[str, Any]:
        """One frame from the manager: ``{"answers": [...]}`` or ``{"reply": ...}``."""
        sock = state["sock"]
        sock.settimeout(self.timeout_s)
        try:
            waiting_since = time.monotonic()
            data, _ = wire.recv_frame(sock, self.max_message_bytes)
            reply = wire.loads(data)
            if not isinstance(reply, dict) or not (isinstance(reply.get("answers"), list) or "reply" in reply):
                raise ValueError("a reply must be {'answers': [...]} or {'reply': ...}")
            sent = reply.get("sent")
            if isinstance(sent, float) and waiting_since <= sent:
                self._add_transit(state, time.monotonic() - sent)
            for answer in reply.get("answers", ()):
                if isinstance(answer, dict) and isinstance(answer.get("transit_in"), float):
                    self._add_transit(state, answer["transit_in"])
            return reply
        except socket.timeout:
            self.reset()
            raise TimeoutError(f"no answer from the LLM manager within {self.timeout_s} s") from None
        except wire.ProtocolError as exc:  # not read: the stream is out of step, drop it
            self.reset()
            raise wire.ProtocolError(f"a reply from the LLM manager at {self.address}: {exc} (the "
                                     "client's max_message_bytes, the manager's max_message_bytes "
                                     "for its clients)") from None
        except ValueError as exc:
            self.reset()
            raise wire.ProtocolError(f"bad reply from the LLM manager at {self.address}: {exc}") from None
        finally:
            if not sock._closed:  # type: ignore[attr-defined]
                sock.settimeout(None)

    def abandon(self, ticket: int) -> None:
        """Stop waiting for ``ticket``, and tell the manager (a streaming engine drops its requests)."""
        state = getattr(_LOCAL, "conns", {}).get(self._key())
        if state is not None and ticket in state["outstanding"]:
            state["outstanding"].discard(ticket)
            state["on_tokens"].pop(ticket, None)
            self._hold(state, wire.frame({"op": "cancel", "ticket": ticket})[wire.HEADER_BYTES:])

    def wait_any(self, timeout: float | None = None) -> tuple[int, list[Completion]] | None:
        """The next answer: its ticket and completions (None past ``timeout``); ``EngineError`` for
        a failed one. Partials that come meanwhile go to their ticket's ``on_tokens``; what that
        callback raises comes out of here, its ticket still outstanding."""
        self.flush()
        state = self._state()
        inbox = state["inbox"]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while not inbox:
                if deadline is not None and not _readable(state["sock"], max(0.0, deadline - time.monotonic())):
                    return None
                reply = self._read_reply(state)
                if "reply" in reply:  # only ever sent in reply to call(), which reads it itself
                    self.reset()
                    raise wire.ProtocolError(f"bad reply from the LLM manager at {self.address}: "
                                             "the reply to a call that was not made")
                inbox.extend(reply["answers"])
            msg = inbox.popleft()
            ticket = msg.get("ticket")
            if "partial" in msg:
                self._partial(state, msg)
                continue
            if ticket not in state["outstanding"]:
                continue  # an answer to a request abandoned after a failure
            state["outstanding"].discard(ticket)
            state["on_tokens"].pop(ticket, None)
            if "error" in msg:
                raise EngineError(msg["error"], ticket, timed_out=msg.get("timed_out") is True,
                                       unavailable=msg.get("unavailable") is True)
            return ticket, [Completion.from_dict(c) for c in msg["completions"]]

    def _partial(self, state: dict[str, Any], msg: dict[str, Any]) -> None:
        """A partial, to its ticket's ``on_tokens`` (none: a ticket answered or abandoned, let go);
        a malformed one is refused as a bad reply is."""
        try:
            ticket, index, ids = messages.read_partial(msg)
        except ValueError as exc:
            self.reset()
            raise wire.ProtocolError(f"bad reply from the LLM manager at {self.address}: {exc}") from None
        callback = state["on_tokens"].get(ticket)
        if callback is not None and ticket in state["outstanding"]:
            callback(index, ids)
