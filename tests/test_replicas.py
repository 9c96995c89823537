"""Replicas (``ragen.llm.replicas``): the router's choices on a fake clock
(least loaded, an episode back to its replica, a failed replica down and
probed with a doubling back-off); scripted replicas, batch and streaming, that
answer as one engine does, fail over to a live replica with the same answer
and raise ``NoReplicaLeft`` naming each replica when none is left; rollouts
over replicas that play the one-engine rollout, with a replica killed midway
too; an outage of every replica waited out up to ``outage_wait_s``, and
one longer failing naming each; the config errors of ``engine.replicas``,
``engine.base_urls`` and ``engine.routing``; openai over fake servers, one
of them stopping, failing for a while or replying malformed; hf replicas on
cpu."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from concurrent.futures import CancelledError, Future

import pytest

from ragen.llm import make_engine
from ragen.llm.replicas import (NoReplicaLeft, ReplicatedEngine, ReplicatedStreamingEngine, Router, Routing,
                                 WaitForReplica)
from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import Completion, GenerationRequest, SamplingParams, StreamingEngine

SAMPLING = SamplingParams(max_tokens=64)


class FakeClock:
    """A clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def req(env_id: int, turn: int = 0, seed: int | None = None) -> GenerationRequest:
    """A request of env ``env_id``; each env a group of its own (its own seed) unless ``seed`` is given."""
    return GenerationRequest([{"role": "user", "content": f"Env {env_id}.\nAvailable actions: Up, Down, Left"}],
                             env_id=env_id, turn=turn, seed=5 + env_id if seed is None else seed)


def answer(request: GenerationRequest, tokens: int = 3) -> Completion:
    return Completion.answering(request, "x", [1], list(range(tokens)), "stop", 0)


def router(n: int = 2, clock: FakeClock | None = None, **routing) -> Router:
    return Router([f"r{i}" for i in range(n)], Routing(**routing), clock=clock or FakeClock())


# -- Router ------------------------------------------------------------------------------------


def test_the_replica_with_the_fewest_requests_in_flight_takes_a_new_episode():
    r = router(3)
    assert [r.pick(req(e)) for e in range(3)] == [0, 1, 2]
    r.done(1, answer(req(1)))
    assert r.pick(req(3)) == 1  # the only one with nothing in flight
    r.done(0, answer(req(0)))
    r.done(2, answer(req(2)))
    assert r.pick(req(4)) == 0


def test_a_later_turn_goes_back_to_its_replica_unless_it_is_busier_by_more_than_the_margin():
    r = router(2, sticky_margin=1)
    assert r.pick(req(0, turn=0)) == 0
    r.done(0, answer(req(0)))
    assert r.pick(req(1)) == 1  # both idle: the one sent fewer requests
    r.done(1, answer(req(1)))
    assert r.pick(req(0, turn=1)) == 0  # both idle: back to its replica, though sent more
    assert r.pick(req(0, turn=2)) == 0  # 1 above the least loaded: within the margin
    assert r.pick(req(0, turn=3)) == 1  # 2 above: the least loaded takes it
    assert r.pick(req(0, turn=4)) == 1  # and the episode stays there
    counts = r.counts()
    assert counts["engine/replica_later_turns"] == 4
    assert counts["engine/replica_returned"] == 3


def test_a_groups_first_turns_go_together_unless_that_replica_is_busier_by_more_than_the_margin():
    """Group members share a seed and their first prompt: computed once on one replica."""
    r = router(2, sticky_margin=2)
    assert [r.pick(req(e, seed=40)) for e in range(4)] == [0, 0, 0, 1]  # the 4th: 3 above the least loaded
    assert [r.pick(req(e, seed=41)) for e in range(4, 6)] == [1, 1]  # another group: the least loaded, then with it
    assert r.pick(req(6, seed=40)) == 1  # the group's last member went to replica 1: the next follows it
    assert r.counts()["engine/replica_later_turns"] == 0  # first turns are not later turns
    r.forget_sessions()
    assert r.pick(req(7, seed=41)) == 0  # forgotten: the least loaded (3 in flight against 4)


def test_an_episode_of_another_seed_is_another_session():
    r = router(2, sticky_margin=100)
    assert r.pick(req(0, seed=1)) == 0
    assert r.pick(req(0, seed=2)) == 1  # same env id, other rollout: least loaded
    assert r.counts()["engine/replica_later_turns"] == 0


def test_a_failed_replica_is_down_then_probed_with_a_doubling_back_off():
    clock = FakeClock()
    r = router(2, clock, probe_s=1.0, probe_max_s=3.0)
    assert r.pick(req(0)) == 0
    r.failed(0, RuntimeError("boom"))
    assert r.counts()["engine/replica_failovers"] == 1
    assert [r.pick(req(e)) for e in (1, 2)] == [1, 1]  # down: skipped, even by its own episode
    assert r.pick(req(0, turn=1)) == 1
    clock.now += 0.99
    assert r.pick(req(3)) == 1
    back_offs = []
    for _ in range(4):  # probes that fail: 1 s, then 2, then 3 (the most), 3
        start = clock.now
        while r.pick(req(9)) != 0:  # waiting for the probe
            clock.now += 0.01
        back_offs.append(round(clock.now - start, 2))
        assert r.pick(req(10)) == 1  # one probe at a time: the others go to the live replica
        r.failed(0, RuntimeError("still down"))
    assert back_offs[1:] == [2.0, 3.0, 3.0]
    clock.now += 3.0
    assert r.pick(req(11)) == 0  # the probe
    r.done(0, answer(req(11)))  # it succeeds: the replica is up again
    assert r.pick(req(12)) == 0  # least loaded again (replica 1 holds the others)
    r.failed(0, RuntimeError("again"))  # a new failure spell starts at probe_s
    clock.now += 1.0
    assert r.pick(req(13)) == 0


def test_one_failure_spell_takes_one_back_off_however_many_requests_fail():
    clock = FakeClock()
    r = router(2, clock, probe_s=1.0)
    for e in range(4):
        r.pick(req(e))  # 0, 1, 0, 1
    r.failed(0, RuntimeError("boom"))
    r.failed(0, RuntimeError("boom"))  # the other request that was on it
    assert r.counts()["engine/replica_failovers"] == 2
    clock.now += 1.0
    assert r.pick(req(5)) == 0  # probed after probe_s, not 2 x probe_s


def test_no_replica_left_names_every_replica_and_its_last_error():
    r = router(2, outage_wait_s=0.0)  # no wait for a probe
    r.pick(req(0))
    r.failed(0, RuntimeError("connection refused"))
    r.pick(req(1))
    r.failed(1, "timed out")
    with pytest.raises(NoReplicaLeft) as caught:
        r.pick(req(2))
    message = str(caught.value)
    assert "r0" in message and "RuntimeError: connection refused" in message
    assert "r1" in message and "timed out" in message
    with pytest.raises(NoReplicaLeft, match="r0.*r1"):  # live but already tried by this request
        router(2, outage_wait_s=0.0).pick(req(0), exclude=[0, 1])


def test_while_every_replica_is_down_a_request_waits_for_probes_until_its_outage_wait():
    clock = FakeClock()
    r = router(2, clock, probe_s=1.0, outage_wait_s=5.0)
    assert [r.pick(req(0)), r.pick(req(1))] == [0, 1]
    r.failed(0, "HTTP 500")
    since = clock.now  # req(0)'s first failure
    clock.now += 0.5
    r.failed(1, "HTTP 500")  # every replica down
    with pytest.raises(WaitForReplica) as told:
        r.pick(req(0), exclude=[0], since=since)
    assert told.value.retry_in_s == pytest.approx(0.5)  # when replica 0 may be probed
    clock.now += 0.5
    assert r.pick(req(0), exclude=[0], since=since) == 0  # the probe, though it failed there: it waits
    with pytest.raises(WaitForReplica) as told:
        r.pick(req(2))  # a new request finds none: its wait starts now
    assert told.value.since == clock.now and told.value.retry_in_s == pytest.approx(0.5)  # replica 1's probe
    r.done(0, answer(req(0)))  # the probe answered: replica 0 is back
    assert r.pick(req(2), since=told.value.since) == 0
    r.failed(0, "HTTP 500")
    since, picks = clock.now, 0
    with pytest.raises(NoReplicaLeft) as caught:
        while True:  # every probe fails; the request waits as told, on the clock
            try:
                r.failed(r.pick(req(2), exclude=[0], since=since), "HTTP 500")
                picks += 1
            except WaitForReplica as wait:
                clock.now += wait.retry_in_s
    assert clock.now >= since + 5.0 and picks >= 2  # probed while it waited
    message = str(caught.value)
    assert "r0: " in message and "r1: " in message and message.count("HTTP 500") == 2, message
    assert "engine.routing.outage_wait_s=5.0" in message, message


def test_a_request_that_failed_on_the_replicas_up_goes_back_to_one_only_while_it_waits():
    clock = FakeClock()
    r = router(2, clock, outage_wait_s=5.0)
    assert r.pick(req(0), exclude=[0, 1], since=clock.now - 1.0) == 0  # they came back after failing it
    with pytest.raises(NoReplicaLeft, match="failed this request"):  # past its wait
        r.pick(req(0), exclude=[0, 1], since=clock.now - 5.0)


def test_forget_sessions_routes_the_next_turn_as_a_new_episode():
    r = router(2, sticky_margin=100)
    assert r.pick(req(0)) == 0
    r.forget_sessions()
    r.pick(req(0, turn=1))
    assert r.counts()["engine/replica_later_turns"] == 0


def test_counts_per_replica_and_busy_time_on_the_clock():
    clock = FakeClock()
    r = router(2, clock)
    r.pick(req(0))
    r.pick(req(1))
    r.called(0)
    r.called(1)
    clock.now += 2.0
    r.done(0, answer(req(0), tokens=4))
    clock.now += 1.0
    r.cancelled(1)
    r.pick(req(2))  # replica 0, in flight for 0.5 s when counted
    clock.now += 0.5
    counts = r.counts()
    assert counts["engine/replica0_requests"] == 1 and counts["engine/replica1_requests"] == 0
    assert counts["engine/replica0_tokens"] == 4
    assert counts["engine/replica0_calls"] == counts["engine/replica1_calls"] == 1
    assert counts["engine/replica0_busy_s"] == pytest.approx(2.5)
    assert counts["engine/replica1_busy_s"] == pytest.approx(3.0)
    assert counts["engine/replica_failovers"] == 0


# -- scripted replicas -------------------------------------------------------------------------

STREAM = {"step_s": 0.001}


def scripted(replicas: int, stream: bool = False, **extra):
    return make_engine({"name": "scripted", "replicas": replicas, "malformed_rate": 0.2,
                        **({"continuous_batching": {**STREAM, **extra.pop("decode", {})}} if stream else {}),
                        **extra})


def requests(n: int = 12) -> list[GenerationRequest]:
    return [req(e, turn=e % 3, seed=7 + e % 2) for e in range(n)]


def without_replica(completions):
    return [dataclasses.replace(c, replica=0) for c in completions]


@pytest.fixture(scope="module")
def one_engine_answers():
    return ScriptedEngine(malformed_rate=0.2).generate(requests(), SAMPLING)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "streaming"])
def test_replicas_answer_as_one_engine_and_both_serve(stream, one_engine_answers):
    engine = scripted(2, stream)
    try:
        assert isinstance(engine, ReplicatedStreamingEngine if stream else ReplicatedEngine)
        got = engine.generate(requests(), SAMPLING)
        counts = engine.replica_counts()
    finally:
        engine.close()
    assert without_replica(got) == one_engine_answers  # text, ids and log-probs
    assert {c.replica for c in got} == {0, 1}
    assert counts["engine/replica0_requests"] > 0 and counts["engine/replica1_requests"] > 0
    assert counts["engine/replica0_requests"] + counts["engine/replica1_requests"] == len(got)
    assert counts["engine/replica_failovers"] == 0
    if not stream:
        assert counts["engine/replica0_calls"] == counts["engine/replica1_calls"] == 1  # one call, split


@pytest.mark.timeout(60)
def test_an_answered_request_leaves_no_cycle_behind(one_engine_answers):
    """The record of a routed request is freed once it is answered, not left in a cycle
    with its futures' callbacks for a full collection (a manager that froze its heap
    runs one seldom, and its RSS grew over env-level rollouts)."""
    from ragen.llm.replicas import _Routed

    engine = scripted(2, True)
    gc.collect()
    gc.disable()
    try:
        futures = engine.submit(requests(), SAMPLING)
        got = [f.result(timeout=30) for f in futures]
        del futures
        time.sleep(0.1)  # the replicas' threads are past their callbacks
        alive = sum(isinstance(o, _Routed) for o in gc.get_objects())
        gc.collect()  # frees what only a cycle kept
        kept = sum(isinstance(o, _Routed) for o in gc.get_objects())
    finally:
        gc.enable()
        engine.close()
    assert without_replica(got) == one_engine_answers
    # a replica may hold its last answered request until its next (the scripted decode loop's
    # local), but nothing is left for the collector
    assert alive == kept < len(got)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "streaming"])
def test_a_closed_replicas_requests_are_answered_by_the_other(stream, one_engine_answers):
    engine = scripted(2, stream)
    try:
        engine.replicas[1].close()
        got = engine.generate(requests(), SAMPLING)
        again = engine.generate(requests(), SAMPLING)  # replica 1 down: all to replica 0
        counts = engine.replica_counts()
    finally:
        engine.close()
    assert without_replica(got) == without_replica(again) == one_engine_answers
    assert {c.replica for c in got} == {c.replica for c in again} == {0}
    assert counts["engine/replica_failovers"] > 0
    assert counts["engine/replica1_requests"] == 0


@pytest.mark.timeout(60)
def test_a_streaming_replica_closed_while_serving_fails_over_with_the_same_answers(one_engine_answers):
    engine = scripted(2, True, decode={"step_s": 0.01, "tokens_median": 30, "tokens_sigma": 0.1})
    try:
        futures = engine.submit(requests(), SAMPLING)
        time.sleep(0.05)  # both replicas are decoding (each answer takes about 30 steps of 10 ms)
        engine.replicas[1].close()
        got = [f.result(timeout=30) for f in futures]
        counts = engine.replica_counts()
    finally:
        engine.close()
    assert without_replica(got) == one_engine_answers
    assert {c.replica for c in got} == {0}
    assert counts["engine/replica_failovers"] > 0


@pytest.mark.timeout(60)
def test_a_batch_replica_closed_between_calls_fails_over_with_the_same_answers(one_engine_answers):
    engine = scripted(2, base_s=0.02)
    try:
        first = engine.generate(requests(), SAMPLING)
        closer = threading.Timer(0.0, engine.replicas[1].close)
        closer.start()
        closer.join(5)
        second = engine.generate(requests(), SAMPLING)
        counts = engine.replica_counts()
    finally:
        engine.close()
    assert {c.replica for c in first} == {0, 1} and {c.replica for c in second} == {0}
    assert without_replica(first) == without_replica(second) == one_engine_answers
    assert counts["engine/replica_failovers"] > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "streaming"])
def test_with_every_replica_closed_no_replica_left_names_each(stream):
    engine = scripted(2, stream, routing={"probe_s": 0.05, "outage_wait_s": 0.2})
    for replica in engine.replicas:
        replica.close()
    try:
        if stream:
            futures = engine.submit(requests(4), SAMPLING)
            errors = [f.exception(timeout=10) for f in futures]
            assert all(isinstance(e, NoReplicaLeft) for e in errors)
            message = str(errors[0])
        else:
            with pytest.raises(NoReplicaLeft) as caught:
                engine.generate(requests(4), SAMPLING)
            message = str(caught.value)
    finally:
        engine.close()
    assert message.count("the engine is closed") == 2, message
    assert "0: " in message and "1: " in message


class HeldEngine(StreamingEngine):
    """A streaming member that keeps every future it hands out, unresolved."""

    def __init__(self) -> None:
        super().__init__()
        self.futures: list[Future] = []

    def submit(self, requests, sampling):
        futures = [Future() for _ in requests]
        self.futures += futures
        return futures


def test_cancelling_a_request_cancels_it_in_its_replica():
    members = [HeldEngine(), HeldEngine()]
    engine = ReplicatedStreamingEngine(members, ["a", "b"])
    outer = engine.submit([req(0), req(1)], SAMPLING)
    assert [len(m.futures) for m in members] == [1, 1]
    assert outer[1].cancel()
    assert members[1].futures[0].cancelled() and not members[0].futures[0].cancelled()
    assert engine.router.replicas[1].in_flight == 0  # no longer counted on its replica
    members[0].futures[0].set_result(answer(req(0)))
    assert outer[0].result(timeout=5).replica == 0
    with pytest.raises(CancelledError):
        outer[1].result(timeout=0)


# -- config errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg,needle", [
    ({"name": "scripted", "replicas": 0}, "engine.replicas must be an integer >= 1, got 0"),
    ({"name": "scripted", "replicas": "2"}, "engine.replicas must be an integer >= 1, got '2'"),
    ({"name": "scripted", "replicas": 1.5}, "engine.replicas must be an integer >= 1"),
    ({"name": "openai", "base_urls": []}, "engine.base_urls must be null or a non-empty list"),
    ({"name": "openai", "base_urls": "http://127.0.0.1:8000/v1"}, "engine.base_urls must be null or a non-empty"),
    ({"name": "openai", "base_urls": ["localhost:8000"]}, "engine.base_urls[0]='localhost:8000' is not a server URL"),
    ({"name": "openai", "base_urls": ["http://a:1/v1", "http://a:1/v1/"]}, "engine.base_urls lists a server twice"),
    ({"name": "openai", "base_urls": ["http://a:1/v1"], "replicas": 2},
     "engine.replicas is not an option of engine 'openai': list the servers in engine.base_urls"),
    ({"name": "scripted", "replicas": 2, "routing": {"sticky_margin": -1}},
     "engine.routing.sticky_margin must be >= 0"),
    ({"name": "scripted", "replicas": 2, "routing": {"probe_s": 0}}, "engine.routing.probe_s must be > 0"),
    ({"name": "openai", "base_urls": ["http://a:1/v1", "http://b:1/v1"], "routing": {"outage_wait_s": -1}},
     "engine.routing.outage_wait_s must be >= 0"),
    ({"name": "scripted", "routing": {"sticky": 1}}, "engine.routing.sticky is not a known key"),
    ({"name": "vllm", "replicas": 2}, "engine.replicas is not an option of engine 'vllm': vLLM spreads itself over "
                                      "GPUs with engine.data_parallel_size"),
    ({"name": "vllm", "data_parallel_size": 2, "streaming": False}, "engine.data_parallel_size=2 needs "
                                                                    "engine.streaming=true"),
    ({"name": "vllm", "data_parallel_size": 0}, "engine.data_parallel_size must be an integer >= 1"),
])
def test_replica_config_errors_name_the_key(cfg, needle):
    with pytest.raises(ValueError) as caught:
        make_engine(cfg, "/nonexistent/model")  # checked before anything is built or imported from the model
    assert needle in str(caught.value)


# -- rollouts over replicas ----------------------------------------------------------------------

VAL = {"env_groups": 6, "group_size": 2,
       "env_configs": {"tags": ["SimpleSokoban", "FrozenLake", "Bandit"], "n_groups": [2, 2, 2]}}
ROLLOUT_MODES = {
    "sequential": {},
    "threading": {"use_parallel_rollout": True, "parallel_backend": "threading"},
    "loky": {"use_parallel_rollout": True},
}


def play(engine, mode: str = "sequential", **agent_proxy):
    """The validation rollout of ``VAL`` on ``engine`` (closed after)."""
    from ragen.llm_agent import LLMAgentProxy

    from tests.rollout_helpers import agent_setup

    try:
        with LLMAgentProxy(agent_setup(val=VAL, **ROLLOUT_MODES[mode], **agent_proxy), engine) as proxy:
            return proxy.rollout("val", rollout_index=1)
    finally:
        engine.close()


def rollout_engine(replicas: int, stream: bool = False):
    return make_engine({"name": "scripted", "replicas": replicas, "malformed_rate": 0.1,
                        **({"continuous_batching": {"step_s": 0.0005, "tokens_median": 20}} if stream else {})})


@pytest.fixture(scope="module")
def one_engine_digest():
    from ragen.rollout.types import rollout_digest

    return rollout_digest(play(rollout_engine(1)).trajectories)


def assert_served_by_both(metrics):
    assert metrics["engine/replica_affinity"] >= 0.9
    assert metrics["engine/replica0_requests"] > 0 and metrics["engine/replica1_requests"] > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,stream", [("sequential", False), ("threading", False), ("loky", False),
                                         ("sequential", True), ("threading", True)],
                         ids=["sequential", "threading", "loky", "sequential-env-level", "threading-env-level"])
def test_a_rollout_over_two_replicas_plays_the_one_engine_rollout(mode, stream, one_engine_digest):
    from ragen.rollout.types import rollout_digest

    result = play(rollout_engine(2, stream), mode)
    assert rollout_digest(result.trajectories) == one_engine_digest
    assert_served_by_both(result.metrics)
    assert result.metrics["engine/replica_failovers"] == 0
    if stream:  # env-level turns: one request a message
        assert result.metrics["engine/requests"] == result.metrics["engine/calls"]


@pytest.mark.timeout(120)
def test_lockstep_turns_over_streaming_replicas_play_the_one_engine_rollout(one_engine_digest):
    from ragen.rollout.types import rollout_digest

    result = play(rollout_engine(2, stream=True), "threading", env_level_async=False)
    assert rollout_digest(result.trajectories) == one_engine_digest
    assert_served_by_both(result.metrics)
    assert result.metrics["engine/requests"] > result.metrics["engine/calls"]  # a request list a turn


def closes_after(base: type, calls: int, **options):
    """A scripted engine of class ``base`` that is closed (from another thread) once it has
    been called ``calls`` times: a replica killed mid-rollout."""

    class Killed(base):
        def __init__(self) -> None:
            super().__init__(**options)
            self.called = 0
            self.killer: threading.Timer | None = None

        def _count(self) -> None:
            self.called += 1
            if self.called == calls:
                self.killer = threading.Timer(0.0, self.close)
                self.killer.start()

        def generate(self, requests, sampling):
            if not self.streams:
                self._count()
            return super().generate(requests, sampling)

        def submit(self, requests, sampling):
            self._count()
            return super().submit(requests, sampling)

    return Killed()


def killed_replicas(stream: bool, kill: int, calls: int = 3) -> list:
    """Two scripted replicas, the first ``kill`` of them closed after ``calls`` calls."""
    from ragen.llm.scripted import ScriptedStreamingEngine

    base = ScriptedStreamingEngine if stream else ScriptedEngine
    options = {"malformed_rate": 0.1,
               **({"continuous_batching": {"step_s": 0.0005, "tokens_median": 20}} if stream else {})}
    return [closes_after(base, calls, **options) if i < kill else base(**options) for i in range(2)]


def replicated(members):
    cls = ReplicatedStreamingEngine if members[0].streams else ReplicatedEngine
    return cls(members, ["first", "second"], Routing(probe_s=30.0, outage_wait_s=0.5))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,stream", [("sequential", False), ("threading", False), ("threading", True)],
                         ids=["sequential", "threading", "threading-env-level"])
def test_a_replica_killed_mid_rollout_leaves_the_rollout_unchanged(mode, stream, one_engine_digest):
    from ragen.rollout.types import rollout_digest

    calls = 9 if stream else 3  # streaming: one request a call, 6 of the first turn's 12 on each replica
    members = killed_replicas(stream, kill=1, calls=calls)
    members.reverse()  # the second replica is killed
    # no parallel retry or sequential fallback: they would re-run envs whose failover raised
    no_rerun = {} if mode == "sequential" else {"fallback_to_sequential": False}
    result = play(replicated(members), mode, **no_rerun)
    assert members[1].called >= calls and members[1].killer is not None  # it was killed
    assert len(result.trajectories) == 12
    assert rollout_digest(result.trajectories) == one_engine_digest
    assert result.metrics["engine/replica_failovers"] > 0
    assert result.metrics.get("parallel/fallbacks", 0) == 0 and result.metrics.get("parallel/retried_tasks", 0) == 0
    assert result.metrics["engine/replica1_requests"] > 0  # it answered before it was killed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,stream", [("sequential", False), ("loky", False), ("threading", True)],
                         ids=["sequential", "loky", "threading-env-level"])
def test_every_replica_killed_fails_the_rollout_naming_each(mode, stream):
    with pytest.raises(Exception) as caught:  # one error for the rollout, not an error per env
        play(replicated(killed_replicas(stream, kill=2, calls=2)), mode)
    message = str(caught.value)
    assert "no replica can take the request" in message, message
    assert "first: " in message and "second: " in message, message
    assert "the engine is closed" in message or "was closed" in message, message


# -- openai: several servers (engine.base_urls) --------------------------------------------------


def chat_requests(tag: str, n: int = 8) -> list[GenerationRequest]:
    return [GenerationRequest([{"role": "user", "content": f"{tag}{i}"}], env_id=i, seed=3 + i) for i in range(n)]


def over_servers(*servers, **options):
    return make_engine({"name": "openai", "base_urls": [s.base_url for s in servers], "model": "m",
                        "max_retries": 1, "backoff_s": 0.01, "timeout_s": 2.0, **options})


@pytest.fixture
def two_servers():
    from tests.test_llm_openai import FakeServer

    servers = [FakeServer(lifetime_s=60.0), FakeServer(lifetime_s=60.0)]
    yield servers
    for server in servers:
        if not server.stopping.is_set():
            server.stop()


@pytest.mark.timeout(60)
def test_requests_spread_over_the_servers_and_fail_over_when_one_stops(two_servers):
    first, second = two_servers
    engine = over_servers(first, second)
    try:
        before = engine.generate(chat_requests("q"), SAMPLING)
        assert first.bodies and second.bodies  # both servers took requests
        assert {c.replica for c in before} == {0, 1}
        second.stop()
        after = engine.generate(chat_requests("q"), SAMPLING)
        counts = engine.replica_counts()
    finally:
        engine.close()
    assert all(c.finish_reason != "error" for c in before + after)
    assert [c.text for c in after] == [c.text for c in before]
    assert all(c.text.startswith(f"<answer>q{i}|") for i, c in enumerate(after))
    assert {c.replica for c in after} == {0}
    assert counts["engine/replica_failovers"] > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["not_json", "no_choices", "negative_ids"])
def test_a_server_with_malformed_replies_fails_over_to_the_others(bad, caplog):
    """Garbage, a reply without choices, or token ids out of range: the server's failure,
    named with its route in the router's warning; its requests go to the other servers."""
    from tests.test_llm_openai import FakeServer

    servers = [FakeServer(), FakeServer(bad_reply=bad), FakeServer()]
    engine = over_servers(*servers, return_token_ids=True)
    try:
        with caplog.at_level("WARNING", logger="ragen.llm.replicas"):
            got = engine.generate(chat_requests("q"), SAMPLING)
        counts = engine.replica_counts()
    finally:
        engine.close()
        for server in servers:
            server.stop()
    assert all(c.finish_reason != "error" for c in got)
    assert all(c.text.startswith(f"<answer>q{i}|") for i, c in enumerate(got))
    assert all(c.response_token_ids == [1, 2, 3] for c in got)
    assert {c.replica for c in got} == {0, 2} and counts["engine/replica_failovers"] > 0
    assert f"malformed reply from {servers[1].base_url}/chat/completions" in caplog.text


def test_replicas_know_their_servers_vocabulary(tiny_model_path):
    engine = make_engine({"name": "openai", "base_urls": ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"],
                          "tokenizer": tiny_model_path})
    try:
        assert engine.vocab_size == engine.replicas[0].vocab_size > 0
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_with_every_server_stopped_no_replica_left_names_both_urls(two_servers):
    engine = over_servers(*two_servers, routing={"probe_s": 0.05, "outage_wait_s": 0.3})
    urls = [s.base_url for s in two_servers]
    for server in two_servers:
        server.stop()
    try:
        futures = engine.submit(chat_requests("q", 2), SAMPLING)
        errors = [f.exception(timeout=30) for f in futures]
    finally:
        engine.close()
    assert all(isinstance(e, NoReplicaLeft) for e in errors), errors
    assert all(url in str(errors[0]) for url in urls), errors[0]


# -- hf replicas on cpu ----------------------------------------------------------------------------


def hf_requests() -> list[GenerationRequest]:
    return [GenerationRequest([{"role": "user", "content": f"Choose {word}."}], env_id=i, seed=1 + i)
            for i, word in enumerate(["dragon", "phoenix", "left or right", "a number"])]


@pytest.fixture(scope="module")
def hf_replicas(tiny_model_path):
    engine = make_engine({"name": "hf", "device": "cpu", "replicas": 2}, tiny_model_path)
    yield engine
    engine.close()


@pytest.mark.timeout(300)
def test_hf_replicas_answer_greedily_as_one_engine(tiny_model_path, hf_replicas):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    one = make_engine({"name": "hf", "device": "cpu"}, tiny_model_path)
    try:
        reference = one.generate(hf_requests(), greedy)
    finally:
        one.close()
    got = hf_replicas.generate(hf_requests(), greedy)
    assert {c.replica for c in got} == {0, 1}
    assert [(c.text, c.response_token_ids) for c in got] == [(c.text, c.response_token_ids) for c in reference]
    for mine, theirs in zip(got, reference):
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)


@pytest.mark.timeout(300)
def test_hf_load_weights_skipping_the_primary_copies_it_into_the_others(hf_replicas):
    import torch

    primary, other = hf_replicas.replicas
    assert hf_replicas.model is primary.model
    with torch.no_grad():  # the trainer's step: the primary's model changed in place
        for p in primary.model.parameters():
            p.add_(0.01)
    assert any(not torch.equal(a, b) for a, b in zip(primary.model.parameters(), other.model.parameters()))
    before = [r.policy_version for r in hf_replicas.replicas]
    version = hf_replicas.load_weights(dict(primary.model.named_parameters()), skip_primary=True)
    assert all(torch.equal(a, b) for a, b in zip(primary.model.parameters(), other.model.parameters()))
    assert [r.policy_version for r in hf_replicas.replicas] == [v + 1 for v in before]
    assert version == hf_replicas.policy_version == before[0] + 1


class Flaky(ScriptedEngine):
    """The scripted policy that refuses every call while ``down`` is set (a replica that
    comes back); streaming when ``stream``."""

    def __init__(self, stream: bool) -> None:
        super().__init__(malformed_rate=0.2)
        self.down = False
        self.streams = stream

    def generate(self, requests, sampling):
        if self.down:
            raise ConnectionError("refused")
        return super().generate(requests, sampling)

    def submit(self, requests, sampling):
        if self.down:
            raise ConnectionError("refused")
        futures = [Future() for _ in requests]
        completions = self.generate(requests, sampling)

        def answer() -> None:  # a moment later, from another thread, as a server's replies come
            for future, completion in zip(futures, completions):
                future.set_result(completion)

        timer = threading.Timer(0.01, answer)
        timer.daemon = True
        timer.start()
        return futures


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "streaming"])
def test_a_replica_that_comes_back_is_probed_and_serves_again(stream, one_engine_answers):
    members = [Flaky(stream), Flaky(stream)]
    cls = ReplicatedStreamingEngine if stream else ReplicatedEngine
    engine = cls(members, ["a", "b"], Routing(probe_s=1.0))
    clock = FakeClock()
    engine.router.clock = clock
    members[1].down = True
    failed = engine.generate(requests(), SAMPLING)
    assert {c.replica for c in failed} == {0}
    members[1].down = False
    clock.now += 0.99
    assert {c.replica for c in engine.generate(requests(), SAMPLING)} == {0}  # down until its back-off passes
    clock.now += 0.01
    back = engine.generate(requests(), SAMPLING)
    assert {c.replica for c in back} == {0, 1}
    assert without_replica(failed) == without_replica(back) == one_engine_answers
    assert engine.replica_counts()["engine/replica_failovers"] > 0


def test_engine_routing_reaches_the_router():
    engine = make_engine({"name": "scripted", "replicas": 3, "routing": {"sticky_margin": 0, "probe_s": 0.5}})
    try:
        assert len(engine.replicas) == 3
        assert engine.router.routing == Routing(sticky_margin=0, probe_s=0.5)
    finally:
        engine.close()
    single = make_engine({"name": "scripted", "replicas": 1})
    assert isinstance(single, ScriptedEngine)  # one replica: the engine itself


def stop_after(server, bodies: int, within_s: float = 30.0) -> threading.Thread:
    """A thread that stops ``server`` once it has taken ``bodies`` requests (or after ``within_s``)."""

    def watch() -> None:
        deadline = time.monotonic() + within_s
        while len(server.bodies) < bodies and time.monotonic() < deadline:
            time.sleep(0.002)
        server.stop()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)
def test_an_env_level_rollout_over_two_servers_survives_one_stopping_mid_way():
    from ragen.llm.openai_engine import OpenAIEngine
    from ragen.rollout.batching import EnvLevel
    from ragen.rollout.scheduler import KeptEnvs, run_envs
    from ragen.serving import StreamingDirectClient

    from tests.rollout_helpers import custom_envs, loop_config, specs_for
    from tests.test_llm_openai import FakeServer

    specs = specs_for(["FrozenLake", "Bandit", "SimpleSokoban"], [2, 1, 1], 2, custom_envs(), seed=7)
    config = loop_config(max_turn=3)
    servers = [FakeServer(policy=ScriptedEngine(malformed_rate=0.1)) for _ in range(3)]
    try:
        one = OpenAIEngine(servers[0].base_url, model="m", max_concurrency=4)
        try:
            reference, _ = run_envs(specs, StreamingDirectClient(one), config, kept_envs=KeptEnvs(), batching=EnvLevel())
        finally:
            one.close()
        engine = over_servers(servers[1], servers[2])
        watcher = stop_after(servers[2], bodies=3)
        try:
            got, _ = run_envs(specs, StreamingDirectClient(engine), config, kept_envs=KeptEnvs(), batching=EnvLevel())
            counts = engine.replica_counts()
        finally:
            engine.close()
        watcher.join(5)
    finally:
        for server in servers:
            if not server.stopping.is_set():
                server.stop()
    assert len(got) == len(specs)
    assert got == reference
    assert all(t.finish_reason != "error" for tr in got for t in tr.turns)
    assert counts["engine/replica1_requests"] > 0 and counts["engine/replica_failovers"] > 0


class SlowToFail(ScriptedEngine):
    """The scripted policy; while ``down``, a call moves ``clock`` on by ``takes_s`` and raises."""

    def __init__(self, clock: FakeClock, takes_s: float = 0.0) -> None:
        super().__init__(malformed_rate=0.2)
        self.clock = clock
        self.takes_s = takes_s
        self.down = False

    def generate(self, requests, sampling):
        if self.down:
            self.clock.now += self.takes_s
            raise ConnectionError("refused")
        return super().generate(requests, sampling)


@pytest.mark.timeout(60)
def test_after_every_replica_failed_a_call_probes_them_and_is_answered(one_engine_answers):
    clock = FakeClock()
    members = [SlowToFail(clock), SlowToFail(clock)]
    engine = ReplicatedEngine(members, ["a", "b"], Routing(probe_s=1.0, outage_wait_s=0.0))
    engine.router.clock = clock
    members[0].down = members[1].down = True
    with pytest.raises(NoReplicaLeft, match="a: .*refused.*b: .*refused"):
        engine.generate(requests(2), SAMPLING)
    members[0].down = members[1].down = False
    clock.now += 1.0
    # more requests than replicas: two probe the replicas, the others wait for their answers
    got = engine.generate(requests(), SAMPLING)
    assert without_replica(got) == one_engine_answers
    assert {c.replica for c in got} == {0, 1}


@pytest.mark.timeout(60)
def test_requests_wait_for_a_probe_and_none_is_left_in_flight(one_engine_answers):
    """A call whose requests failed on every live replica while the back-off of a third passed:
    one request probes the third, the others wait for its answer and go there too."""
    clock = FakeClock()
    members = [SlowToFail(clock, takes_s=0.5), SlowToFail(clock, takes_s=0.5), SlowToFail(clock)]
    engine = ReplicatedEngine(members, ["a", "b", "c"], Routing(probe_s=1.0, outage_wait_s=0.0))
    engine.router.clock = clock
    members[2].down = True
    assert {c.replica for c in engine.generate(requests(3), SAMPLING)} == {0, 1}  # c failed: down for 1 s
    members[2].down = False
    members[0].down = members[1].down = True
    got = engine.generate(requests(), SAMPLING)  # a and b take the call's time to fail: c's back-off passes
    assert without_replica(got) == one_engine_answers
    assert {c.replica for c in got} == {2}
    busy = engine.replica_counts()
    clock.now += 10.0
    later = engine.replica_counts()
    for i in range(3):  # nothing left in flight
        assert later[f"engine/replica{i}_busy_s"] == busy[f"engine/replica{i}_busy_s"]


@pytest.mark.timeout(60)
def test_after_every_streaming_replica_failed_requests_wait_for_the_probes(one_engine_answers):
    members = [Flaky(stream=True), Flaky(stream=True)]
    engine = ReplicatedStreamingEngine(members, ["a", "b"], Routing(probe_s=1.0, outage_wait_s=0.0))
    clock = FakeClock()
    engine.router.clock = clock
    members[0].down = members[1].down = True
    errors = [f.exception(timeout=10) for f in engine.submit(requests(2), SAMPLING)]
    assert all(isinstance(e, NoReplicaLeft) for e in errors), errors
    members[0].down = members[1].down = False
    clock.now += 1.0
    # more requests than replicas: two probe the replicas, the others wait for their answers
    got = [f.result(timeout=10) for f in engine.submit(requests(), SAMPLING)]
    assert without_replica(got) == one_engine_answers
    members[0].down = members[1].down = True
    clock.now += 10.0
    # the probes fail: the requests that waited for them fail too, naming both replicas
    errors = [f.exception(timeout=10) for f in engine.submit(requests(), SAMPLING)]
    assert all(isinstance(e, NoReplicaLeft) for e in errors), errors
    assert "a: " in str(errors[-1]) and "b: " in str(errors[-1])


class HeldFlaky(HeldEngine):
    """``HeldEngine`` that refuses requests while ``down`` and cancels those it holds when closed."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def submit(self, requests, sampling):
        if self.down:
            raise ConnectionError("refused")
        return super().submit(requests, sampling)

    def close(self) -> None:
        for future in self.futures:
            future.cancel()
        super().close()


@pytest.mark.timeout(30)
def test_closing_fails_the_requests_waiting_for_a_probe():
    members = [HeldFlaky(), HeldFlaky()]
    engine = ReplicatedStreamingEngine(members, ["a", "b"], Routing(probe_s=1.0, outage_wait_s=0.0))
    clock = FakeClock()
    engine.router.clock = clock
    members[0].down = members[1].down = True
    assert all(isinstance(f.exception(timeout=5), NoReplicaLeft) for f in engine.submit(requests(2), SAMPLING))
    members[0].down = members[1].down = False
    clock.now += 1.0
    futures = engine.submit(requests(4), SAMPLING)  # two probes held, two requests waiting for them
    assert [len(m.futures) for m in members] == [1, 1] and not any(f.done() for f in futures)
    engine.close()
    errors = [f.exception(timeout=5) for f in futures]
    assert all(isinstance(e, RuntimeError) and "closed" in str(e) for e in errors), errors


# -- an outage of every replica: waited out up to engine.routing.outage_wait_s ----------------------


def when_all_down(engine, then, within_s: float = 30.0) -> threading.Thread:
    """A thread that calls ``then()`` once every replica of ``engine`` is down (or after ``within_s``)."""

    def watch() -> None:
        deadline = time.monotonic() + within_s
        while not all(r.down for r in engine.router.replicas) and time.monotonic() < deadline:
            time.sleep(0.002)
        then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def answers_of(engine, stream: bool, reqs) -> list:
    if stream:
        return [f.result(timeout=30) for f in engine.submit(reqs, SAMPLING)]
    return engine.generate(reqs, SAMPLING)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "streaming"])
def test_an_outage_of_every_replica_shorter_than_the_outage_wait_is_waited_out(stream, one_engine_answers):
    members = [Flaky(stream), Flaky(stream)]
    cls = ReplicatedStreamingEngine if stream else ReplicatedEngine
    engine = cls(members, ["a", "b"], Routing(probe_s=0.02, probe_max_s=0.1, outage_wait_s=60.0))
    members[0].down = members[1].down = True

    def come_back() -> None:
        members[0].down = members[1].down = False

    watcher = when_all_down(engine, come_back)
    try:
        got = answers_of(engine, stream, requests())
        counts = engine.replica_counts()
    finally:
        engine.close()
    watcher.join(5)
    assert without_replica(got) == one_engine_answers
    assert counts["engine/replica_failovers"] >= 2  # both were down


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "streaming"])
def test_an_outage_longer_than_the_outage_wait_fails_naming_each_replica(stream):
    members = [Flaky(stream), Flaky(stream)]
    cls = ReplicatedStreamingEngine if stream else ReplicatedEngine
    engine = cls(members, ["a", "b"], Routing(probe_s=0.02, probe_max_s=0.05, outage_wait_s=0.3))
    members[0].down = members[1].down = True
    reqs = requests(4)
    try:
        if stream:
            errors = [f.exception(timeout=30) for f in engine.submit(reqs, SAMPLING)]
            assert all(isinstance(e, NoReplicaLeft) for e in errors), errors
            message = str(errors[-1])
        else:
            with pytest.raises(NoReplicaLeft) as caught:
                engine.generate(reqs, SAMPLING)
            message = str(caught.value)
        failovers = engine.replica_counts()["engine/replica_failovers"]
    finally:
        engine.close()
    assert "a: " in message and "b: " in message and message.count("refused") == 2, message
    assert "engine.routing.outage_wait_s=0.3" in message, message
    assert failovers > 2 * len(reqs)  # probed while it waited, not only tried once on each


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True], ids=["batch", "streaming"])
def test_closing_fails_the_requests_waiting_out_an_outage(stream):
    members = [Flaky(stream), Flaky(stream)]
    cls = ReplicatedStreamingEngine if stream else ReplicatedEngine
    engine = cls(members, ["a", "b"], Routing(probe_s=30.0, outage_wait_s=60.0))
    members[0].down = members[1].down = True
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            engine.generate(requests(4), SAMPLING)
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    caller = threading.Thread(target=generate, daemon=True)
    caller.start()
    when_all_down(engine, lambda: None).join(10)
    engine.close()
    caller.join(10)
    assert not caller.is_alive() and len(errors) == 1, errors
    assert isinstance(errors[0], RuntimeError) and "closed" in str(errors[0]), errors


@pytest.mark.timeout(60)
def test_an_outage_of_every_server_shorter_than_the_outage_wait_is_waited_out(two_servers):
    """Both servers answer HTTP 500 for a while (each request retried once): the requests
    wait for the probes and are answered once the servers are back."""
    engine = over_servers(*two_servers, routing={"probe_s": 0.05, "probe_max_s": 0.2, "outage_wait_s": 60.0})
    for server in two_servers:
        server.failing = True

    def come_back() -> None:
        for server in two_servers:
            server.failing = False

    try:
        futures = engine.submit(chat_requests("q"), SAMPLING)
        watcher = when_all_down(engine, come_back)
        got = [f.result(timeout=30) for f in futures]
        counts = engine.replica_counts()
    finally:
        engine.close()
    watcher.join(5)
    assert all(server.failures > 0 for server in two_servers)
    assert all(c.finish_reason != "error" for c in got)
    assert all(c.text.startswith(f"<answer>q{i}|") for i, c in enumerate(got))
    assert counts["engine/replica_failovers"] > 0
