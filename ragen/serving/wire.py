"""The wire between workers and the shared manager: frames of plain data and the handshake.

A frame is a 4-byte big-endian length and a pickle of plain data (dicts,
lists, strings, bytes, numbers), written by a pickler and read by an
unpickler that refuse every class and function: as safe as JSON, and cheaper
to encode and decode (the full message history of every env travels each
turn). Each side refuses a frame longer than its ``max_message_bytes`` and
closes the connection (the stream is out of step), so a sender checks its own
message against that limit first (``send_frame``, ``MessageTooLarge``). What
a frame decodes to is bounded too: at most ``MAX_REQUESTS`` requests
(``messages`` checks the rest).

The handshake, within one deadline in all: manager -> client ``b"RAGEN4"``
and a 32-byte nonce; client -> manager ``HMAC-SHA256(key, b"ragen client" +
that nonce)`` and a nonce of its own; the manager checks the HMAC (a wrong one
closes the connection), then sends the frame ``{"ok": True, "proof":
HMAC-SHA256(key, b"ragen server" + the client's nonce)}``, which the client
checks before it sends anything. Nothing else is read before the key is
proven, and a worker never takes answers from a server that lacks the key.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import pickle
import secrets
import socket
import struct
import time
from typing import Any

from ragen.errors import ConfigError, ProtocolError, RagenError

MAGIC = b"RAGEN4"  # the protocol's version: a manager and a client of different versions refuse each other
NONCE_BYTES = 32
DIGEST_BYTES = hashlib.sha256().digest_size
# Each side proves the key over its own label, so what one side answers can
# never be replayed as the other's proof.
CLIENT_LABEL, SERVER_LABEL = b"ragen client", b"ragen server"
_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size  # a frame's length prefix
MAX_FRAME_BYTES = (1 << 32) - 1  # the longest frame: its length prefix is 4 bytes
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # the longest frame a side reads unless told (max_message_bytes)

# Requests in one frame (a batch's messages together). A frame's length bounds
# its bytes, not the objects it decodes to: pickle can name one request (or one
# history) many times, and each request costs the manager objects many times
# its size on the wire. An honest worker sends one request an env.
MAX_REQUESTS = 1 << 14


def check_max_message_bytes(value: Any, key: str = "max_message_bytes", least: int = 1) -> int:
    """``value`` as the longest message a side reads: an integer from ``least`` to
    ``MAX_FRAME_BYTES``; ``ConfigError`` naming ``key`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_FRAME_BYTES:
        raise ConfigError(f"{key} must be an integer from {least} to 2**32 - 1 (a frame's length is 4 bytes), "
                         f"got {value!r}")
    return value


class AuthenticationError(RagenError, ConnectionError):
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
