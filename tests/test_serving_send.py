"""The manager's answers to a peer that stops reading (issue 42, defect 3):
they wait in that connection's own send queue, the other peers' answers go
on, and once the queue passes its bound the peer is dropped with a warning
naming it. No thread of the send path outlives the manager's close."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import Completion, GenerationRequest, SamplingParams
from ragen.serving import SharedLLMInferenceManager, messages, wire

from tests.inference_helpers import ask
from tests.unread_peer import kernel_buffers

pytestmark = pytest.mark.timeout(60)

ANSWER_BYTES = 1 << 20  # the answer to each of the stuck peer's requests
BIG_ENV = 100  # env ids from here on get answers of ANSWER_BYTES


class BigAnswers(ScriptedEngine):
    """Answers env ids from ``BIG_ENV`` on with ``ANSWER_BYTES`` characters, the others as the scripted policy."""

    def generate(self, requests, sampling):
        got = super().generate(requests, sampling)
        return [Completion(**{**c.to_dict(), "text": "x" * ANSWER_BYTES}) if r.env_id >= BIG_ENV else c
                for c, r in zip(got, requests)]


def _requests(n, env0=0):
    return [GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}],
                              env_id=env0 + i, turn=0, seed=1) for i in range(n)]


def _stuck_peer(shared) -> socket.socket:
    """A peer that proves the key like a worker and will never read its answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # before connecting: no autotuning
    sock.settimeout(10)
    sock.connect(shared.address)
    wire.client_handshake(sock, shared._key, shared.address, 10)
    return sock


def _ask_big(sock, n, ticket0):
    """``n`` requests, each its own message, each answered with ``ANSWER_BYTES``."""
    for i in range(n):
        wire.send_frame(sock, {"op": "gen", "ticket": ticket0 + i, "requests": [messages.request_for_wire(r) for r in
                                                                                 _requests(1, BIG_ENV + i)],
                               "sampling": SamplingParams().to_dict()})


def _wait_for(what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _send_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ragen-llm-send") and t.is_alive()]


def test_a_peer_that_stops_reading_delays_only_its_own_answers(caplog):
    """A peer asks for answers far larger than the kernel holds, and never
    reads them. A worker asking meanwhile is answered (the review's worker
    waited for as long as the stuck peer did not read); once the stuck
    peer's queue passes ``max_send_queue_bytes`` it is dropped, named in a
    warning, and the worker goes on being answered."""
    bound = 32 << 20
    stuck_first = kernel_buffers() + 4 * ANSWER_BYTES  # more than the kernel holds, less than the bound
    assert stuck_first + 2 * ANSWER_BYTES < bound
    with caplog.at_level(logging.WARNING, logger="ragen.serving"), \
            SharedLLMInferenceManager(BigAnswers(), max_send_queue_bytes=bound) as shared:
        stuck = _stuck_peer(shared)
        try:
            n_first = stuck_first // ANSWER_BYTES
            _ask_big(stuck, n_first, 1)
            _wait_for(lambda: shared.stats.requests >= n_first)  # the engine answered them all
            # well under the time the peer stays stuck (until the end of the test)
            worker = shared.client(timeout_s=15)
            assert [c.env_id for c in ask(worker, _requests(2), SamplingParams())] == [0, 1]
            assert not [r for r in caplog.records if "dropped" in r.getMessage()]  # under its bound: kept

            _ask_big(stuck, bound // ANSWER_BYTES + 4, n_first + 1)  # past the bound
            peer = "%s:%d" % stuck.getsockname()[:2]
            _wait_for(lambda: [r for r in caplog.records if "dropped" in r.getMessage()])
            warnings = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
            assert len(warnings) == 1 and peer in warnings[0] and "max_send_queue_bytes" in warnings[0]
            assert [c.env_id for c in ask(worker, _requests(3), SamplingParams())] == [0, 1, 2]
        finally:
            stuck.close()
    _wait_for(lambda: not _send_threads(), timeout_s=5)


def test_close_ends_the_sends_to_a_stuck_peer():
    """The manager closes while answers wait for a peer that does not read:
    close() returns, and no thread of the send path is left."""
    with SharedLLMInferenceManager(BigAnswers()) as shared:
        stuck = _stuck_peer(shared)
        n = kernel_buffers() // ANSWER_BYTES + 4
        _ask_big(stuck, n, 1)
        _wait_for(lambda: shared.stats.requests >= n)
        _wait_for(lambda: _send_threads(), timeout_s=10)  # answers wait in its queue
        shared.close()
        assert not _send_threads()
        stuck.close()


def test_the_send_queue_bound_is_checked():
    with pytest.raises(ValueError, match="max_send_queue_bytes"):
        SharedLLMInferenceManager(ScriptedEngine(), max_send_queue_bytes=0)
    with SharedLLMInferenceManager(ScriptedEngine(), max_message_bytes=1 << 20) as shared:
        assert shared.max_send_queue_bytes == 2 << 20  # the default: two of the largest frames


def test_without_non_blocking_sends_every_frame_goes_through_the_sender(monkeypatch):
    """Where the platform has no MSG_DONTWAIT, the sender thread sends every
    frame, in order, and ends once its queue is empty."""
    from ragen import send_queue

    monkeypatch.setattr(send_queue, "_DONTWAIT", None)
    with SharedLLMInferenceManager(BigAnswers()) as shared:
        worker = shared.client(timeout_s=15)
        for n in (1, 3, 2):
            assert [c.env_id for c in ask(worker, _requests(n), SamplingParams())] == list(range(n))
        assert len(ask(worker, _requests(2, BIG_ENV), SamplingParams())[0].text) == ANSWER_BYTES
        _wait_for(lambda: not _send_threads(), timeout_s=5)
