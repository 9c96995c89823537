"""The manager's path to an engine that streams (``Streamer``), the
sequential rollout's (``StreamingDirectClient``) and the engine gate
(``EngineGate``) against a streaming engine that breaks its contract or never
answers (issue 42): every request leaves the gate, by its answer, its
timeout, its cancel or its error; a broken call fails alone, naming the
engine and what it returned; the manager goes on serving; and a weight swap
gets the gate, or says what it waited for."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import EngineError, GenerationRequest, SamplingParams, StreamingEngine
from ragen.serving import SharedLLMInferenceManager
from ragen.serving.gate import EngineGate

from tests.inference_helpers import ask

pytestmark = pytest.mark.timeout(60)


def _requests(n, env0=0):
    return [GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}],
                              env_id=env0 + i, turn=0, seed=1) for i in range(n)]


class Spoiling(StreamingEngine):
    """The scripted policy, answered at once; its first ``submit`` returns
    ``spoil(futures, requests)`` instead of one resolved future per request."""

    name = "spoiling"

    def __init__(self, spoil):
        super().__init__()
        self.inner = ScriptedEngine()
        self.spoil = spoil
        self.calls = 0
        self.handed_out: list[Future] = []

    def submit(self, requests, sampling):
        futures = []
        for r in requests:
            f: Future = Future()
            f.set_result(self.inner.generate([r], sampling)[0])
            futures.append(f)
        self.calls += 1
        return self.spoil(futures, requests, self) if self.calls == 1 else futures


def _running(n, engine):
    """``n`` futures that run and never resolve: a hung ``ThreadPoolExecutor`` call (cannot be cancelled)."""
    out = []
    for _ in range(n):
        f: Future = Future()
        f.set_running_or_notify_cancel()
        out.append(f)
    engine.handed_out += out
    return out


def _gate_is_free(gate, within_s=10.0):
    """Whether another thread gets the gate as a lock (a weight swap) within ``within_s``."""
    got = threading.Event()

    def swap():
        with gate:
            got.set()

    threading.Thread(target=swap, daemon=True).start()
    return got.wait(within_s)


def _dict_completion(futures, requests, engine):
    f: Future = Future()
    f.set_result(futures[0].result().to_dict())
    return [f] + futures[1:]


# (spoil, what the error names besides the engine)
BREAKS = {
    "none": (lambda fs, rs, e: None, "returned None"),
    "one_future": (lambda fs, rs, e: fs[0], "returned a Future"),
    "too_few": (lambda fs, rs, e: fs[:-1], "2 futures for 3 requests"),
    "too_few_running": (lambda fs, rs, e: _running(2, e), "2 futures for 3 requests"),
    "too_many": (lambda fs, rs, e: fs + fs[:1], "4 futures for 3 requests"),
    "too_many_running": (lambda fs, rs, e: _running(4, e), "4 futures for 3 requests"),
    "not_futures": (lambda fs, rs, e: [f.result() for f in fs], "Completion, not a Future"),
    "resolves_to_dict": (_dict_completion, "dict, not a Completion"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(BREAKS))
def test_an_engine_that_breaks_its_contract_fails_that_call_alone(name):
    """The call's requests get an error naming the engine and what it returned;
    the gate's count is back to 0 (a weight swap gets it), and the next
    requests are answered. ``none`` and ``not_futures`` killed the connection's
    thread and then the streamer's, so that no later answer came; ``too_many``
    counted the gate below 0, and ``too_few`` left it above."""
    spoil, what = BREAKS[name]
    engine = Spoiling(spoil)
    with SharedLLMInferenceManager(engine, request_timeout_s=20) as shared:
        client = shared.client(timeout_s=10)
        with pytest.raises(EngineError, match="spoiling") as info:
            ask(client, _requests(3), SamplingParams())
        assert what in str(info.value)
        assert not info.value.timed_out  # at once, not at the request's timeout
        assert shared.engine_lock.in_flight == 0
        assert _gate_is_free(shared.engine_lock)
        assert [c.env_id for c in ask(client, _requests(2, env0=5), SamplingParams())] == [5, 6]
        assert [c.env_id for c in ask(shared.client(timeout_s=10), _requests(1), SamplingParams())] == [0]
        assert shared.engine_lock.in_flight == 0


class Hangs(StreamingEngine):
    """Answers at once, except ``env_id`` ``hung``: its future runs and never resolves."""

    name = "hangs"

    def __init__(self, hung):
        super().__init__()
        self.inner = ScriptedEngine()
        self.hung = hung
        self.kept: list[Future] = []

    def submit(self, requests, sampling):
        futures = []
        for r in requests:
            f: Future = Future()
            if r.env_id == self.hung:
                f.set_running_or_notify_cancel()
                self.kept.append(f)
            else:
                f.set_result(self.inner.generate([r], sampling)[0])
            futures.append(f)
        return futures


@pytest.mark.timeout(30)
def test_a_request_that_timed_out_leaves_the_gate():
    """A running future that never resolves cannot be cancelled: its request
    stayed in the gate for ever, and the next weight swap waited for it."""
    engine = Hangs(hung=1)
    with SharedLLMInferenceManager(engine, request_timeout_s=0.5) as shared:
        client = shared.client(timeout_s=10)
        with pytest.raises(EngineError, match="engine_timeout_s=0.5") as info:
            ask(client, _requests(2), SamplingParams())
        assert info.value.timed_out
        assert shared.engine_lock.in_flight == 0
        assert _gate_is_free(shared.engine_lock)
        assert [c.env_id for c in ask(client, _requests(1, env0=3), SamplingParams())] == [3]


@pytest.mark.timeout(30)
def test_a_request_its_worker_gave_up_on_leaves_the_gate():
    """The worker cancels a ticket whose future runs (its own engine_timeout_s ran
    out first): the request leaves the gate although the engine cannot drop it."""
    engine = Hangs(hung=0)
    with SharedLLMInferenceManager(engine) as shared:  # no timeout of the manager's own
        client = shared.client(timeout_s=10)
        client.open_streams(1)
        ticket = client.submit(_requests(1), SamplingParams())
        deadline = time.monotonic() + 10
        while not engine.kept and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shared.engine_lock.in_flight == 1
        client.abandon(ticket)
        client.flush()
        assert _gate_is_free(shared.engine_lock)
        assert shared.engine_lock.in_flight == 0
        assert [c.env_id for c in ask(client, _requests(1, env0=4), SamplingParams())] == [4]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", [{"use_parallel_rollout": True, "parallel_backend": "threading"},
                                     {"use_parallel_rollout": False}], ids=["manager", "sequential"])
def test_a_weight_swap_after_an_env_level_rollout_with_a_hung_request(backend):
    """The issue's case: an env ends in timeout on a request whose future hangs
    running, and the trainer's next ``with engine_lock`` gets the gate (the
    shared manager's, or the sequential rollout's own)."""
    from ragen.llm_agent import LLMAgentProxy
    from ragen.rollout.types import StopReason
    from tests.rollout_helpers import agent_setup

    engine = Hangs(hung=-1)
    setup = agent_setup(engine_timeout_s=1.0, **backend)
    with LLMAgentProxy(setup, engine) as proxy:
        engine.hung = proxy.rollout("val", rollout_index=1).specs[1].env_id
        got = proxy.rollout("val", rollout_index=1)
        i = next(k for k, s in enumerate(got.specs) if s.env_id == engine.hung)
        assert got.trajectories[i].stop_reason == StopReason.TIMEOUT
        assert engine.kept and not any(f.done() for f in engine.kept)
        assert _gate_is_free(proxy.engine_lock)
        assert proxy.engine_lock.in_flight == 0


# ----- the gate's own waits -------------------------------------------------------------

@pytest.mark.timeout(30)
def test_a_weight_swap_waits_for_requests_in_flight_within_a_bound_and_says_for_what():
    gate = EngineGate(timeout_s=0.3)
    gate.enter(3)  # requests that never leave: an engine's bug
    with pytest.raises(TimeoutError, match=r"engine lock.* 3 requests in flight") as info:
        with gate:
            pass
    assert "0.3" in str(info.value)
    assert not gate.locked() and gate.in_flight == 3
    gate.leave(3)
    with gate:  # the failed wait left nothing behind
        assert gate.locked()


@pytest.mark.timeout(30)
def test_a_request_waits_for_a_held_lock_within_a_bound_and_says_for_what():
    gate = EngineGate(timeout_s=10)
    gate.acquire()
    with pytest.raises(TimeoutError, match=r"2 requests .*engine lock.*held"):
        gate.enter(2, timeout=0.2)
    assert gate.in_flight == 0
    gate.release()
    gate.enter(2, timeout=0.2)
    assert gate.in_flight == 2
    gate.leave(2)


@pytest.mark.timeout(30)
def test_a_long_wait_for_the_gate_is_logged_with_what_it_waits_for(caplog):
    gate = EngineGate(timeout_s=None)
    gate.report_every_s = 0.1
    gate.enter(1)
    swap = threading.Thread(target=lambda: gate.acquire() and gate.release())
    with caplog.at_level(logging.WARNING, logger="ragen.serving.gate"):
        swap.start()
        deadline = time.monotonic() + 10
        while not any("1 requests in flight" in r.getMessage() for r in caplog.records) and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        gate.leave(1)
        swap.join(10)
    assert not swap.is_alive()
    assert any("waited" in r.getMessage() and "1 requests in flight" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(30)
def test_a_request_held_out_by_a_weight_swap_past_its_timeout_is_answered_timed_out():
    """The connection's thread waited for the gate without a bound: the worker's
    later messages (its cancels) were not read while a swap held it."""
    engine = Spoiling(lambda fs, rs, e: fs)
    with SharedLLMInferenceManager(engine, request_timeout_s=0.5) as shared:
        client = shared.client(timeout_s=10)
        shared.engine_lock.acquire()
        try:
            with pytest.raises(EngineError, match="engine lock") as info:
                ask(client, _requests(1), SamplingParams())
            assert info.value.timed_out and shared.engine_lock.in_flight == 0
        finally:
            shared.engine_lock.release()
        assert [c.env_id for c in ask(client, _requests(1), SamplingParams())] == [0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["none", "too_few_running", "not_futures"])
def test_the_sequential_streaming_client_refuses_a_broken_submit_and_leaves_the_gate(name):
    from ragen.serving import StreamingDirectClient

    spoil, what = BREAKS[name]
    gate = EngineGate(timeout_s=10)
    client = StreamingDirectClient(Spoiling(spoil), gate)
    with pytest.raises(TypeError, match="spoiling") as info:
        client.submit(_requests(3), SamplingParams())
    assert what in str(info.value) and gate.in_flight == 0
    ticket = client.submit(_requests(2), SamplingParams())
    assert client.wait_any(timeout=10)[0] == ticket and gate.in_flight == 0


@pytest.mark.timeout(30)
def test_the_lock_waits_for_another_holder_past_the_bound():
    """The bound is for requests in flight: a batch engine call (or a swap) that
    holds the lock longer than it is waited out (its call ends by itself)."""
    gate = EngineGate(timeout_s=0.1)
    gate.acquire()  # a batch call that hangs past engine_timeout_s
    errors, got = [], threading.Event()

    def second():
        try:
            with gate:
                got.set()
        except TimeoutError as exc:
            errors.append(exc)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(0.5)  # five bounds: past the bound, still waiting
    assert thread.is_alive() and not errors
    gate.release()
    thread.join(10)
    assert got.is_set() and not errors
