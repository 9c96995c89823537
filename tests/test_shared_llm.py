"""SharedLLMInferenceManager over its socket: coalesced calls, the lock, and a
server that keeps serving through bad clients. (The coalescing policy on its
own, on a fake clock: test_inference_coalescer.py.)"""

from __future__ import annotations

import dataclasses
import pickle
import socket
import struct
import time
import threading

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import EngineError, GenerationRequest, SamplingParams
from ragen.serving import Hooks, ProtocolError, Reply, SharedLLMInferenceManager

from tests.inference_helpers import ask


def _requests(n, env0=0):
    return [GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}],
                              env_id=env0 + i, turn=0, seed=1) for i in range(n)]


class CountingEngine(ScriptedEngine):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = []

    def generate(self, requests, sampling):
        self.calls.append(len(requests))
        return super().generate(requests, sampling)


def test_four_shards_at_once_make_at_most_two_engine_calls():
    engine = CountingEngine(base_s=0.05)
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.5) as shared:
        client = shared.client()
        barrier = threading.Barrier(4)
        out = {}

        def shard(i):
            client.open_streams(1)
            barrier.wait()
            out[i] = ask(client, _requests(8, env0=8 * i), SamplingParams())
            client.close_stream()

        threads = [threading.Thread(target=shard, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(engine.calls) <= 2
    assert sum(engine.calls) == 32
    for i in range(4):
        assert [c.env_id for c in out[i]] == list(range(8 * i, 8 * i + 8))


def test_batches_respect_max_batch_size():
    engine = CountingEngine()
    with SharedLLMInferenceManager(engine, max_batch_size=5) as shared:
        got = ask(shared.client(), _requests(12), SamplingParams())
    assert len(got) == 12 and max(engine.calls) <= 5


def test_answers_equal_direct_engine_calls():
    engine = ScriptedEngine(malformed_rate=0.3)
    reqs = _requests(10)
    reqs[3:6] = [dataclasses.replace(r, answer_prefix="<think>") for r in reqs[3:6]]  # it travels with them
    # second turns that append to their first turn's ids
    firsts = engine.generate(reqs[:3], SamplingParams())
    reqs += [dataclasses.replace(r, turn=1, history_token_ids=c.prompt_token_ids + c.response_token_ids,
                                 history_messages=len(r.messages) + 1,
                                 messages=r.messages + [{"role": "assistant", "content": c.text},
                                                        {"role": "user", "content": "next"}])
             for r, c in zip(reqs[:3], firsts)]
    with SharedLLMInferenceManager(engine) as shared:
        got = ask(shared.client(), reqs, SamplingParams())
    want = engine.generate(reqs, SamplingParams())
    assert got[:10] == want[:10]
    # an appended prompt crosses as the ids after the request's history, which the worker holds
    for r, c, w in zip(reqs[10:], got[10:], want[10:]):
        assert c.prompt_start == len(r.history_token_ids) > 0
        assert r.history_token_ids + c.prompt_token_ids == w.prompt_token_ids
        assert dataclasses.replace(c, prompt_token_ids=w.prompt_token_ids, prompt_start=0) == w
    assert all(c.logprobs and len(c.logprobs) == len(c.response_token_ids) for c in got)


def test_client_pickles_without_showing_the_key():
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        client = shared.client()
        assert "authkey" not in repr(client) and repr(shared._key) not in repr(client)
        clone = pickle.loads(pickle.dumps(client))
        assert ask(clone, _requests(1), SamplingParams())[0].text


def test_wrong_key_is_refused_and_server_goes_on():
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        bad = type(shared.client())(address=shared.address, authkey=b"x" * 32)
        with pytest.raises(ConnectionRefusedError):
            ask(bad, _requests(1), SamplingParams())
        assert ask(shared.client(), _requests(2), SamplingParams())


def _raw(shared):
    s = socket.create_connection(shared.address, timeout=5)
    return s


def test_garbage_and_oversized_frames_do_not_stop_the_server():
    # small, yet room for 3 answers with their token ids and log-probs
    with SharedLLMInferenceManager(ScriptedEngine(), max_message_bytes=4096) as shared:
        # garbage instead of a handshake
        s = _raw(shared)
        s.recv(64)
        s.sendall(b"\x00garbage" * 100)
        s.close()
        # a client that connects and says nothing does not block others
        silent = _raw(shared)
        client = shared.client()
        assert len(ask(client, _requests(3), SamplingParams())) == 3
        # an authenticated client sending a malformed message gets an error, then goes on
        sock = client._state()["sock"]
        payload = b"{not json"
        sock.sendall(struct.pack(">I", len(payload)) + payload)
        with pytest.raises(EngineError, match="bad message"):
            # the error reply has ticket null; mark it outstanding to receive it
            client._state()["outstanding"].add(None)
            client.wait_any()
        assert len(ask(client, _requests(2), SamplingParams())) == 2
        # an oversized frame closes only that connection
        sock.sendall(struct.pack(">I", 10**9))
        client.reset()
        assert len(ask(shared.client(), _requests(2), SamplingParams())) == 2
        deadline = time.monotonic() + 10  # the oversized frame's connection is read on a thread of its own
        while shared.stats.bad_messages < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shared.stats.bad_messages >= 2
        silent.close()


def test_client_disconnecting_mid_request_is_survived():
    engine = ScriptedEngine(base_s=0.3)
    with SharedLLMInferenceManager(engine) as shared:
        client = shared.client()
        client.submit(_requests(4), SamplingParams())
        client.reset()  # leaves with its request in flight
        assert len(ask(shared.client(), _requests(2), SamplingParams())) == 2


def test_engine_failure_reaches_the_client():
    class Broken(ScriptedEngine):
        def generate(self, requests, sampling):
            raise RuntimeError("GPU on fire")

    with SharedLLMInferenceManager(Broken()) as shared:
        with pytest.raises(EngineError, match="GPU on fire"):
            ask(shared.client(), _requests(1), SamplingParams())


def test_answers_to_one_worker_come_in_one_frame():
    engine = CountingEngine(base_s=0.05)
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.5) as shared:
        client = shared.client()
        client.open_streams(2)
        t1 = client.submit(_requests(3), SamplingParams())
        t2 = client.submit(_requests(2, env0=3), SamplingParams())
        first = client.wait_any()
        assert len(client._state()["inbox"]) == 1  # the other answer came in the same frame
        got = dict([first, client.wait_any()])
        client.close_stream()
        client.close_stream()
    assert engine.calls == [5]
    assert [c.env_id for c in got[t1]] == [0, 1, 2] and [c.env_id for c in got[t2]] == [3, 4]
    assert shared.stats.bytes_out > 0


class _Recorder:
    """An observer and note handler that records what it is told."""

    def __init__(self):
        self.events = []
        self.told = threading.Event()

    def engine_call(self, size):
        self.events.append(("engine_call", size))

    def answered(self, n):
        self.events.append(("answered", n))
        self.told.set()

    def note(self, n):
        self.events.append(("note", n))


def test_calls_notes_and_the_observer_of_a_tag_reach_its_hooks():
    """A call under a tag is answered by its handler and opens the streams
    it says; notes ride on the next message to the tag's note handlers; the
    observer hears of the engine call and the answers; a withdrawn tag's
    calls are answered None and its notes go nowhere."""
    seen = _Recorder()
    hooks = Hooks(calls={"echo": lambda payload: Reply({"got": payload}, streams=2)},
                  notes={"done": seen.note}, observer=seen)
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        tag = shared.announce(2, hooks)
        client = dataclasses.replace(shared.client(timeout_s=30), tag=tag)
        assert client.call("echo", [1, "a"]) == {"got": [1, "a"]}
        assert shared.open_streams == 2 and shared.announced == {tag: 0}
        client.note("done", 2)
        client.note("done", 1)
        assert len(ask(client, _requests(3), SamplingParams())) == 3
        assert seen.told.wait(10)
        assert seen.events == [("note", 3), ("engine_call", 3), ("answered", 3)]
        shared.withdraw(tag)
        assert shared.hooked == () and shared.open_streams == 0
        assert client.call("echo", 1) is None
        client.note("done", 5)
        client.close_stream()
        assert len(ask(client, _requests(1), SamplingParams())) == 1  # the connection goes on
    assert ("note", 5) not in seen.events


def test_notes_sent_alone_from_a_fresh_connection_reach_its_tags_hooks_and_the_stats_count_streams():
    """A thread that sends nothing else (a worker's agent episodes) sends its notes on their own,
    under its client's tag, without opening a stream; each engine call counts the streams open."""
    seen = _Recorder()
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        tag = shared.announce(1, Hooks(notes={"done": seen.note}))
        client = dataclasses.replace(shared.client(timeout_s=30), tag=tag)
        client.note("done", 4)
        client.send_notes()
        client.send_notes()  # nothing noted since: nothing sent
        client.open_streams(1, announced=False)
        assert len(ask(client, _requests(2), SamplingParams())) == 2
        assert shared.announced == {tag: 1}  # a stream not announced leaves the announcement
        client.close_stream()
        deadline = time.monotonic() + 10
        while ("note", 4) not in seen.events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen.events.count(("note", 4)) == 1
        stats = shared.stats.snapshot()
        assert stats.calls_started == 1 and stats.streams_at_calls == 1


def test_a_call_that_cannot_be_answered_fails_alone():
    def broken(payload):
        raise RuntimeError("no chunk")

    hooks = Hooks(calls={"bad": broken, "opaque": lambda payload: Reply(object())})
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        client = dataclasses.replace(shared.client(timeout_s=30), tag=shared.announce(0, hooks))
        with pytest.raises(ProtocolError, match="RuntimeError: no chunk"):
            client.call("bad")
        with pytest.raises(ProtocolError, match="no handler of calls of kind 'unknown'"):
            client.call("unknown")
        with pytest.raises(ProtocolError, match="not plain data"):
            client.call("opaque")
        assert shared.open_streams == 0
        assert len(ask(client, _requests(2), SamplingParams())) == 2  # the connection goes on


class _Exploit:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this would create a file
        return (open, (str(self.path), "w"))


def test_frames_carry_only_data_never_objects(tmp_path):
    target = tmp_path / "pwned"
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        client = shared.client()
        sock = client._state()["sock"]
        payload = pickle.dumps({"op": "gen", "ticket": 1, "requests": [_Exploit(target)]})
        sock.sendall(struct.pack(">I", len(payload)) + payload)
        client._state()["outstanding"].add(None)
        with pytest.raises(EngineError, match="plain data"):
            client.wait_any()
        assert not target.exists()
        assert len(ask(client, _requests(2), SamplingParams())) == 2  # and it goes on serving


@pytest.mark.timeout(60)
def test_a_client_whose_socket_is_numbered_past_1024_waits_for_its_answer():
    """A process with many connections (a worker whose gateway serves an agent flooding its session)
    numbers its next sockets past 1024, where select() fails: the client's wait and ready() poll."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1200, hard), hard))
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    assert fillers[-1] >= 1024  # the sockets opened next are numbered past them
    try:
        with SharedLLMInferenceManager(ScriptedEngine()) as shared:
            client = shared.client()
            client.submit(_requests(2), SamplingParams())
            deadline = time.monotonic() + 30
            while not client.ready() and time.monotonic() < deadline:
                time.sleep(0.01)
            ticket, completions = client.wait_any(timeout=30)
            assert len(completions) == 2
            client.reset()
    finally:
        for fd in fillers:
            os.close(fd)
