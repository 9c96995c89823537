"""Partials (``ragen.serving.partials``): a request that asks for its ids as they are sampled
(``stream_tokens``) gets them on the wire before its answer, through the manager's coalesced
path and its streamer; a request that does not ask crosses the wire as it always did; a
malformed ``stream_tokens`` or partial is refused, naming it."""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import replace

import pytest

from ragen.llm.scripted import ScriptedEngine, ScriptedStreamingEngine
from ragen.llm.types import GenerationRequest, SamplingParams
from ragen.serving import SharedLLMInferenceManager, messages, wire
from ragen.serving.shared_client import SharedLLMClient

from tests.inference_helpers import ask
from tests.test_serving_send import _stuck_peer, _wait_for
from tests.unread_peer import kernel_buffers

pytestmark = pytest.mark.timeout(60)

SAMPLING = SamplingParams(seed=4, max_tokens=512)


def _requests(n):
    return [GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}],
                              env_id=i, turn=0, seed=1) for i in range(n)]


def _streamed(client, reqs):
    """``reqs`` submitted with ``on_tokens``: the events in their order (``(index, ids)`` for each
    partial, ``"answer"`` once the ticket's answer is back) and the completions."""
    events: list = []
    ticket = client.submit(reqs, SAMPLING, on_tokens=lambda index, ids: events.append((index, ids)))
    got, completions = client.wait_any(30)
    assert got == ticket
    events.append("answer")
    return events, completions


@pytest.mark.parametrize("make", [ScriptedEngine, lambda: ScriptedStreamingEngine(
    continuous_batching={"step_s": 0.001, "tokens_median": 30, "tokens_sigma": 0.0})], ids=["coalesced", "streamer"])
def test_partials_reach_the_callback_before_the_answer_and_join_to_its_ids(make):
    engine = make()
    with SharedLLMInferenceManager(engine) as manager:
        client = manager.client(timeout_s=30)
        events, completions = _streamed(client, _requests(2))
        assert events[-1] == "answer" and len(events) > 2  # several partials, all before the answer
        for index, completion in enumerate(completions):
            ids = [i for event in events[:-1] if event[0] == index for i in event[1]]
            assert ids == completion.response_token_ids
        # the same requests without on_tokens: the same answers
        ticket = client.submit(_requests(2), SAMPLING)
        got, plain = client.wait_any(30)
        assert got == ticket and [c.response_token_ids for c in plain] == [c.response_token_ids
                                                                           for c in completions]
    engine.close()


def test_a_request_that_does_not_stream_crosses_the_wire_as_before():
    request = _requests(1)[0]
    assert "stream_tokens" not in messages.request_for_wire(request)
    assert messages.request_for_wire(replace(request, stream_tokens=True))["stream_tokens"] is True


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_stream_tokens_that_is_not_a_boolean_is_refused_naming_it(value):
    raw = {**messages.request_for_wire(_requests(1)[0]), "stream_tokens": value}
    data = wire.frame({"op": "gen", "ticket": 3, "requests": [raw], "sampling": {}})[wire.HEADER_BYTES:]
    with pytest.raises(messages.BadMessage, match=r"requests\[0\]\.stream_tokens must be true or false") as exc:
        messages.parse_message(data)
    assert exc.value.ticket == 3


@pytest.mark.parametrize("partial, field", [
    ({"ticket": "1", "index": 0, "partial": b"\0" * 4}, "'ticket'"),
    ({"ticket": 1, "index": -1, "partial": b"\0" * 4}, "'index'"),
    ({"ticket": 1, "index": 0, "partial": b"\0" * 3}, "'partial'"),
    ({"ticket": 1, "index": 0, "partial": b""}, "'partial'"),
    ({"ticket": 1, "index": 0, "partial": [1, 2]}, "'partial'"),
])
def test_a_malformed_partial_is_refused_by_the_client_naming_its_field(partial, field):
    """A manager (here a fake one that holds the key) that sends a malformed partial: the client
    refuses it as a bad reply, naming the field, and drops the connection."""
    key = b"k" * 32
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        sock, _ = listener.accept()
        with sock:
            wire.server_handshake(sock, key, 5.0)
            wire.recv_frame(sock, 1 << 20)  # the gen message
            sock.sendall(wire.frame({"answers": [partial]}))
            sock.recv(1)  # until the client drops the connection

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = SharedLLMClient(address=listener.getsockname()[:2], authkey=key, timeout_s=10)
    try:
        client.submit(_requests(1), SAMPLING, on_tokens=lambda index, ids: None)
        with pytest.raises(wire.ProtocolError, match=f"a partial's {field}"):
            client.wait_any(10)
    finally:
        client.reset()
        thread.join(5)
        listener.close()


PARTIAL_IDS = 1 << 18  # 1 MiB of ids in each partial of BigPartials


class BigPartials(ScriptedEngine):
    """Tells each streaming request 1 MiB of ids ``reports`` times, then answers as the scripted policy."""

    def __init__(self, reports):
        super().__init__()
        self.reports = reports

    def generate_reporting(self, requests, sampling, on_tokens):
        for _ in range(self.reports if on_tokens is not None else 0):
            on_tokens({i: [65] * PARTIAL_IDS for i, r in enumerate(requests) if r.stream_tokens})
        return super().generate_reporting(requests, sampling, None)


def test_a_peer_that_does_not_read_its_partials_is_dropped_and_the_others_are_answered(caplog):
    """Partials go through the connection's bounded queue: a peer that asks for them and never
    reads is dropped once they pass ``max_send_queue_bytes``, named in a warning, and the engine
    call and a worker's answers go on. The partials pass what the kernel's buffers absorb too
    (on loopback, about tcp_wmem's largest send buffer of an unread connection)."""
    bound = kernel_buffers() + (4 << 20)
    with caplog.at_level(logging.WARNING, logger="ragen"), \
            SharedLLMInferenceManager(BigPartials((kernel_buffers() + bound) // (4 * PARTIAL_IDS) + 4),
                                      max_send_queue_bytes=bound) as shared:
        stuck = _stuck_peer(shared)
        try:
            request = replace(_requests(1)[0], stream_tokens=True)
            wire.send_frame(stuck, {"op": "gen", "ticket": 1, "requests": [messages.request_for_wire(request)],
                                    "sampling": SAMPLING.to_dict()})
            _wait_for(lambda: shared.stats.requests >= 1)  # the engine call ended
            warnings = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
            assert len(warnings) == 1 and "%s:%d" % stuck.getsockname()[:2] in warnings[0]
            assert "max_send_queue_bytes" in warnings[0]
            assert [c.env_id for c in ask(shared.client(timeout_s=15), _requests(2), SAMPLING)] == [0, 1]
        finally:
            stuck.close()
