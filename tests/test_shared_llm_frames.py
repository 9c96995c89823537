"""What one frame may make the manager do (issue 42): a frame's decoded content is
bounded as well as its length (history ids, requests, batched messages: pickle
lets a frame name one object many times), a batch of bad messages is answered in
one reply with one warning, and a request whose history ids are outside the
engine's vocabulary is refused alone, before it joins an engine call."""

from __future__ import annotations

import logging
import pickle
import re
import tracemalloc

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import EngineError, GenerationRequest, SamplingParams
from ragen.serving import SharedLLMInferenceManager, messages, wire

from tests.inference_helpers import ask

pytestmark = pytest.mark.timeout(60)


def _requests(n, env0=0, **fields):
    return [GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}],
                              env_id=env0 + i, turn=0, seed=1, **fields) for i in range(n)]


def _raw(request):
    return messages.request_for_wire(request)


def _payload(msg):
    """A message as a client's frame carries it (pickle keeps shared objects shared)."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _exchange(sock, payload):
    """Sends ``payload`` as one frame over an authenticated socket; the reply's answers."""
    sock.sendall(len(payload).to_bytes(wire.HEADER_BYTES, "big") + payload)
    return wire.loads(wire.recv_frame(sock, 64 << 20)[0])["answers"]


def _errors(answers):
    return [a["error"] for a in answers]


def _gen(ticket, requests):
    return {"op": "gen", "ticket": ticket, "requests": requests, "sampling": {}}


def _shared_history():
    """80 requests that all name one history of 192 Ki ids (768 KiB): a frame of under 1 MiB
    that decoded to 80 lists of those ids."""
    history = bytes(4 * 3 * (1 << 16))
    return _payload(_gen(1, [{**_raw(r), "history_token_ids": history} for r in _requests(80)]))


def _shared_batch_item():
    """One gen message of 768 KiB of history, named 100 times in a batch: each was decoded anew."""
    item = _payload(_gen(1, [{**_raw(_requests(1)[0]), "history_token_ids": bytes(4 * 3 * (1 << 16))}]))
    return _payload({"op": "batch", "msgs": [item] * 100})


def _many_requests():
    """200,000 tiny requests (one messages list shared by all) in a frame of about 3 MiB."""
    chat = [{"role": "user", "content": "x"}]
    return _payload(_gen(1, [{"messages": chat, "env_id": i} for i in range(200_000)]))


FRAMES = {
    "shared_history": (_shared_history, "history and prompt ids .* more than the .* bytes of the message"),
    "shared_batch_item": (_shared_batch_item, "'msgs' .* more than the .* bytes of the frame"),
    "many_requests": (_many_requests, r"at most \d+ requests .*MAX_REQUESTS"),
}


@pytest.mark.parametrize("name", FRAMES)
def test_a_frame_is_refused_before_it_decodes_to_more_than_it_holds(name):
    """The review's frames raised the manager's RSS by 317, 401 and 484 MB. Each is
    refused, naming the bound, before its content is turned into objects: the
    decoding of the whole frame allocates a few times the frame's own size at
    most (tracemalloc counts what Python allocates, so no RSS is measured), where
    the shared history and the shared batch item allocated over 100 MiB."""
    make, bound = FRAMES[name]
    data = make()
    tracemalloc.start()
    try:
        with pytest.raises(messages.BadMessage, match=bound):
            messages.parse_message(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the many small requests are decoded by the unpickler itself (dicts of fields)
    # before they can be counted: about 16 times their bytes on the wire
    assert peak < 24 * len(data), f"decoding a frame of {len(data)} bytes allocated {peak} bytes"



def _ask_bad_and_good(client, bad, sampling):
    """Two streams: ``bad`` (one request list) and two good requests, both asked before either
    is answered. Their tickets, the good answers' env ids by ticket and the (ticket, error)s."""
    client.open_streams(2)
    bad_ticket = client.submit(bad, sampling)
    good_ticket = client.submit(_requests(2), sampling)
    got, errors = {}, []
    while len(got) + len(errors) < 2:
        try:
            ticket, completions = client.wait_any()
            got[ticket] = [c.env_id for c in completions]
        except EngineError as exc:
            errors.append((exc.ticket, str(exc)))
            client.close_stream()  # as the worker's loop does once its envs ended
    client.close_stream()
    return bad_ticket, good_ticket, got, errors

@pytest.mark.parametrize("name", FRAMES)
def test_the_manager_refuses_such_a_frame_and_answers_the_others(name):
    make, bound = FRAMES[name]
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        client = shared.client(timeout_s=20)
        sock = client._state()["sock"]
        errors = _errors(_exchange(sock, make()))
        assert errors and all(e.startswith("bad message") and re.search(bound, e) for e in errors)
        # the same connection, and another one, are answered as before
        assert [c.env_id for c in ask(client, _requests(2), SamplingParams())] == [0, 1]
        assert len(ask(shared.client(timeout_s=20), _requests(1), SamplingParams())) == 1


def test_a_batch_whose_messages_together_pass_the_request_bound_is_refused_whole(monkeypatch):
    """The bound is on the frame: two messages under it that together pass it are
    refused, each ticket answered with the bound, in one reply."""
    monkeypatch.setattr(wire, "MAX_REQUESTS", 8)
    items = [_payload(_gen(t, [_raw(r) for r in _requests(5, env0=5 * t)])) for t in (1, 2)]
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        client = shared.client(timeout_s=20)
        answers = _exchange(client._state()["sock"], _payload({"op": "batch", "msgs": items}))
        assert sorted(a["ticket"] for a in answers) == [1, 2]
        assert all(re.search(r"at most 8 requests .*MAX_REQUESTS", e) for e in _errors(answers))
        assert len(ask(client, _requests(8), SamplingParams())) == 8  # at the bound: answered


def test_a_worker_holding_more_requests_than_a_frame_carries_sends_several_frames(monkeypatch):
    monkeypatch.setattr(wire, "MAX_REQUESTS", 4)
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        client = shared.client(timeout_s=20)
        tickets = {client.submit(_requests(3, env0=3 * i), SamplingParams(), hold=True): i for i in range(5)}
        got = {}
        while len(got) < len(tickets):
            ticket, completions = client.wait_any()
            got[tickets[ticket]] = [c.env_id for c in completions]
    assert got == {i: [3 * i, 3 * i + 1, 3 * i + 2] for i in range(5)}


def test_a_batch_of_bad_messages_is_answered_once_with_one_warning(caplog):
    """65,536 bad items made 65,536 reply frames and as many warnings: now one
    reply answers every bad ticket (each with its own reason), one warning gives
    their number and the first reason, and the batch's good message is served."""
    n = 1000
    bad = [_payload(_gen(t, [{**_raw(_requests(1, env0=t)[0]), "seed": "x"}])) for t in range(1, n + 1)]
    good = _payload(_gen(n + 1, [_raw(r) for r in _requests(2)]))
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            caplog.at_level(logging.WARNING, logger="ragen.serving"):
        client = shared.client(timeout_s=20)
        sock = client._state()["sock"]
        first = _exchange(sock, _payload({"op": "batch", "msgs": bad + [good]}))
        second = wire.loads(wire.recv_frame(sock, 64 << 20)[0])["answers"]
        answers = first + second
        assert sorted(a["ticket"] for a in answers) == list(range(1, n + 2))
        assert [a["ticket"] for a in answers if "completions" in a] == [n + 1]
        assert all("requests[0].seed must be an integer" in a["error"] for a in answers if "error" in a)
        # the bad ones came in one frame, whichever of the two it was
        assert len(first) == n or len(second) == n
        assert shared.stats.bad_messages == n
        assert len(ask(client, _requests(1), SamplingParams())) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(n) in warnings[0] and "requests[0].seed must be an integer" in warnings[0]


# ----- token ids outside the engine's vocabulary ---------------------------------------

def test_history_ids_outside_the_vocabulary_are_refused_alone():
    """The scripted engine's ids are bytes (a vocabulary of 256): a request whose
    history holds 300 is refused, naming its env, turn and the id; a request
    of another worker queued with it is answered."""
    engine = ScriptedEngine()
    bad = _requests(1, env0=9, history_token_ids=[1, 2, 300], history_messages=1)
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.0, max_coalesce_wait_s=5.0) as shared:
        bad_ticket, good_ticket, got, errors = _ask_bad_and_good(shared.client(timeout_s=20), bad, SamplingParams())
    assert got == {good_ticket: [0, 1]}
    assert [t for t, _ in errors] == [bad_ticket]
    assert re.search(r"env_id 9, turn 0.*token id 300 is outside the vocabulary's 256 ids", errors[0][1])
    assert engine.vocab_size == 256


@pytest.mark.timeout(300)
def test_an_out_of_vocabulary_id_fails_only_its_request_in_a_coalesced_hf_call(tiny_model_path):
    """Two workers' requests for one hf call; one worker's history holds an id past
    the model's embedding: that one's ticket ends in error naming the id, the
    other's is answered (one bad id failed both with IndexError)."""
    from ragen.llm.hf import HFEngine

    engine = HFEngine(tiny_model_path, device="cpu")
    vocab = engine.model.get_input_embeddings().num_embeddings
    bad = _requests(1, env0=9, history_token_ids=[1, 2, vocab + 5], history_messages=1)
    sampling = SamplingParams(max_tokens=4)
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.0, max_coalesce_wait_s=5.0) as shared:
        bad_ticket, good_ticket, got, errors = _ask_bad_and_good(shared.client(timeout_s=60), bad, sampling)
    assert got == {good_ticket: [0, 1]}
    assert [t for t, _ in errors] == [bad_ticket]
    assert f"token id {vocab + 5}" in errors[0][1] and "env_id 9" in errors[0][1]
    assert engine.vocab_size == vocab
