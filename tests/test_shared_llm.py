"""SharedLLMInferenceManager: coalescing, the lock, and a server that keeps
serving through bad clients."""

from __future__ import annotations

import dataclasses
import pickle
import socket
import struct
import threading
import time

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import GenerationRequest, SamplingParams
from ragen.llm_agent.shared_llm import EngineError, SharedLLMInferenceManager


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
            out[i] = client.generate(_requests(8, env0=8 * i), SamplingParams())
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
        got = shared.client().generate(_requests(12), SamplingParams())
    assert len(got) == 12 and max(engine.calls) <= 5


def test_answers_equal_direct_engine_calls():
    engine = ScriptedEngine(malformed_rate=0.3)
    reqs = _requests(10)
    with SharedLLMInferenceManager(engine) as shared:
        got = shared.client().generate(reqs, SamplingParams())
    want = engine.generate(reqs, SamplingParams())
    # token ids stay in the driver: workers read the text
    assert [dataclasses.replace(c, prompt_token_ids=[], response_token_ids=[]) for c in want] == got


def test_client_pickles_without_showing_the_key():
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        client = shared.client()
        assert "authkey" not in repr(client) and repr(shared._key) not in repr(client)
        clone = pickle.loads(pickle.dumps(client))
        assert clone.generate(_requests(1), SamplingParams())[0].text


def test_wrong_key_is_refused_and_server_goes_on():
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        bad = type(shared.client())(address=shared.address, authkey=b"x" * 32)
        with pytest.raises(ConnectionRefusedError):
            bad.generate(_requests(1), SamplingParams())
        assert shared.client().generate(_requests(2), SamplingParams())


def _raw(shared):
    s = socket.create_connection(shared.address, timeout=5)
    return s


def test_garbage_and_oversized_frames_do_not_stop_the_server():
    with SharedLLMInferenceManager(ScriptedEngine(), max_message_bytes=1024) as shared:
        # garbage instead of a handshake
        s = _raw(shared)
        s.recv(64)
        s.sendall(b"\x00garbage" * 100)
        s.close()
        # a client that connects and says nothing does not block others
        silent = _raw(shared)
        client = shared.client()
        assert len(client.generate(_requests(3), SamplingParams())) == 3
        # an authenticated client sending a malformed message gets an error, then goes on
        sock = client._state()["sock"]
        payload = b"{not json"
        sock.sendall(struct.pack(">I", len(payload)) + payload)
        with pytest.raises(EngineError, match="bad message"):
            # the error reply has ticket null; mark it outstanding to receive it
            client._state()["outstanding"].add(None)
            client.wait_any()
        assert len(client.generate(_requests(2), SamplingParams())) == 2
        # an oversized frame closes only that connection
        sock.sendall(struct.pack(">I", 10**9))
        client.reset()
        assert len(shared.client().generate(_requests(2), SamplingParams())) == 2
        assert shared.stats.bad_messages >= 2
        silent.close()


def test_client_disconnecting_mid_request_is_survived():
    engine = ScriptedEngine(base_s=0.3)
    with SharedLLMInferenceManager(engine) as shared:
        client = shared.client()
        client.submit(_requests(4), SamplingParams())
        client.reset()  # leaves with its request in flight
        assert len(shared.client().generate(_requests(2), SamplingParams())) == 2


def test_engine_failure_reaches_the_client():
    class Broken(ScriptedEngine):
        def generate(self, requests, sampling):
            raise RuntimeError("GPU on fire")

    with SharedLLMInferenceManager(Broken()) as shared:
        with pytest.raises(EngineError, match="GPU on fire"):
            shared.client().generate(_requests(1), SamplingParams())


def _idle_conn(turn_s, idle, last_request=0.0):
    from ragen.llm_agent.shared_llm import _Conn

    conn = _Conn(sock=None, peer="test", streams=len(idle))
    conn.turn_s = list(turn_s)
    conn.idle.extend(idle)
    conn.last_request = last_request
    return conn


def test_coalescer_waits_only_for_workers_due_within_the_budget():
    with SharedLLMInferenceManager(ScriptedEngine()) as shared:
        real = shared._conns
        deadline = 10.05
        # a worker that answers in 10 ms per stream, answered at t=10: due at 10.01
        shared._conns = {_idle_conn([0.01, None], [(10.0, True)])}
        assert shared._expects_before(deadline)
        # one that needs 100 ms is not worth waiting for: go now
        shared._conns = {_idle_conn([0.1, None], [(10.0, True)])}
        assert not shared._expects_before(deadline)
        # a worker serves its streams one after another: the second is due 20 ms after the answers
        assert _idle_conn([0.01, None], [(10.0, True), (10.0, True)]).expected() == pytest.approx([10.01, 10.02])
        # its third would come after the deadline: the first two are still worth waiting for
        shared._conns = {_idle_conn([0.02, None], [(10.0, True)] * 3)}
        assert shared._expects_before(deadline)
        # a stream still resetting its envs, with no estimate yet: wait
        shared._conns = {_idle_conn([0.01, None], [(10.0, False)])}
        assert shared._expects_before(deadline)
        # resets are learned apart from env steps
        shared._conns = {_idle_conn([0.01, 0.5], [(10.0, False)])}
        assert not shared._expects_before(deadline)
        shared._conns = real


def test_call_cost_model_fits_the_fixed_cost_only_when_call_sizes_differ():
    from ragen.llm_agent.shared_llm import CallCostModel

    model = CallCostModel()
    assert model.fixed_s() is None  # no calls yet
    for n in (8, 32, 64, 128) * 3:
        model.add(n, 0.002 + 0.0001 * n)
    assert model.fixed_s() == pytest.approx(0.002)
    # every call about the same size, times that vary with other things (prompt
    # lengths on a GPU): the intercept would be noise, so the cost is unknown
    alike = CallCostModel()
    for n, t in [(128, 2.9), (112, 2.1), (128, 3.3), (120, 2.2), (128, 2.6)] * 4:
        alike.add(n, t)
    assert alike.fixed_s() is None


def test_a_stream_later_than_predicted_is_still_waited_for_within_the_budget():
    engine = CountingEngine()
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.0) as shared:
        for n in (8, 32, 64, 128):  # a fitted fixed cost of 0.5 s per call
            shared.call_cost.add(n, 0.5 + 0.001 * n)
        client = shared.client()
        client.open_streams(2)
        while len(shared._conns) != 1 or len(next(iter(shared._conns)).idle) != 2:
            time.sleep(0.001)  # the manager registers the connection and its streams
        next(iter(shared._conns)).turn_s = [0.001, 0.001]  # its streams usually come 1 ms apart
        client.submit(_requests(3), SamplingParams())
        time.sleep(0.1)  # this time the second is 100 ms late, still well within 0.5 s
        client.submit(_requests(2, env0=3), SamplingParams())
        client.wait_any(), client.wait_any()
        client.close_stream()
        client.close_stream()
    assert engine.calls == [5]


def test_an_engine_of_unknown_cost_waits_for_every_stream_expected():
    """Before the manager knows what a call costs, it waits (up to
    max_coalesce_wait_s) for the streams still resetting, instead of sending
    the first arrivals alone: on a GPU a split call costs a whole decode."""
    engine = CountingEngine()
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.0, max_coalesce_wait_s=5.0) as shared:
        client = shared.client()
        client.open_streams(2)
        t1 = client.submit(_requests(3), SamplingParams())
        time.sleep(0.3)  # the second micro-batch is still resetting its envs
        t2 = client.submit(_requests(2, env0=3), SamplingParams())
        got = dict([client.wait_any(), client.wait_any()])
        client.close_stream()
        client.close_stream()
    assert engine.calls == [5]
    assert sorted(got) == [t1, t2]


def test_worker_time_per_stream_is_learned_from_its_requests():
    conn = _idle_conn([None, None], [(1.0, False), (1.0, False)], last_request=0.0)
    conn.request_arrived(1.2)  # first stream reset in 0.2 s
    conn.request_arrived(1.5)  # the second, after the first: 0.3 s
    assert conn.turn_s[1] == pytest.approx(0.7 * 0.2 + 0.3 * 0.3)
    assert conn.turn_s[0] is None
    conn.idle.append((2.0, True))
    conn.request_arrived(2.05)  # stepped in 50 ms after its answer
    assert conn.turn_s[0] == pytest.approx(0.05)
    assert conn.expected() == []


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
        assert len(client.generate(_requests(2), SamplingParams())) == 2  # and it goes on serving


def test_streams_announced_by_the_driver_are_waited_for_before_their_worker_connects():
    engine = CountingEngine()
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.0, max_coalesce_wait_s=5.0) as shared:
        rollout = shared.announce(2)  # two shards of one stream each were dispatched
        client = dataclasses.replace(shared.client(), rollout=rollout)

        def late_worker():
            time.sleep(0.3)  # its process picks up the shard late
            client.open_streams(1)
            client.generate(_requests(2, env0=3), SamplingParams())
            client.close_stream()

        thread = threading.Thread(target=late_worker)
        thread.start()
        client.open_streams(1)
        assert len(client.generate(_requests(3), SamplingParams())) == 3
        client.close_stream()
        thread.join()
        assert engine.calls == [5]
        # once the rollout is over, nothing of it is expected any more
        shared.withdraw(rollout)
        client.open_streams(1)
        client.generate(_requests(1), SamplingParams())
        client.close_stream()
    assert engine.calls == [5, 1]
