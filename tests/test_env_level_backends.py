"""Env-level turns (``agent_proxy.env_level_async``) in every backend: the
lockstep loop's trajectories, refused where the engine cannot stream, a lost
request bounded by ``engine_timeout_s``, messages that do not grow with envs
x turns, and the engine gate that weight swaps take."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from concurrent.futures import Future

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import GenerationRequest, SamplingParams, StreamingEngine
from ragen.llm_agent import LLMAgentProxy
from ragen.rollout.proxy import AgentSetup
from ragen.rollout.backends import make_backend
from ragen.rollout.types import StopReason
from ragen.serving import SharedLLMInferenceManager
from ragen.serving.coalescer import Pending
from ragen.serving.gate import EngineGate
from ragen.serving.stats import ManagerStats
from ragen.serving.streamer import Streamer

from tests.fault_envs import exiting_group
from tests.rollout_helpers import agent_setup, streaming_engine


VAL = {"env_groups": 6, "group_size": 2,
       "env_configs": {"tags": ["SimpleSokoban", "FrozenLake", "Bandit"], "n_groups": [2, 2, 2]}}


def setup_for(**agent_proxy) -> AgentSetup:
    return agent_setup(val=VAL, **agent_proxy)


MODES = {
    "sequential": {},
    "loky": {"use_parallel_rollout": True},
    "loky_one_worker": {"use_parallel_rollout": True, "parallel_n_jobs": 1},
    "loky_chunks": {"use_parallel_rollout": True, "max_env_num_per_worker": 2},
    "threading": {"use_parallel_rollout": True, "parallel_backend": "threading"},
    "multiprocessing": {"use_parallel_rollout": True, "parallel_backend": "multiprocessing"},
    "generate_ahead": {"use_parallel_rollout": True, "async_generation_ratio": 1},
    "fully_async": {"rollout_mode": "fully_async", "parallel_backend": "threading"},
}


def play(mode: str, engine, **extra):
    with LLMAgentProxy(setup_for(**MODES[mode], **extra), engine) as proxy:
        return proxy.rollout("val", rollout_index=1), proxy.next_train_batch(0)


@pytest.fixture(scope="module")
def reference():
    """RAGEN's lockstep loop on the batch engine."""
    return play("sequential", ScriptedEngine(malformed_rate=0.1))


def by_env(trajectories):
    return sorted(trajectories, key=lambda t: t.env_id)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_backend_plays_env_level_to_the_lockstep_trajectories(mode, reference):
    """The validation rollout is the sequential loop's; the training batch the same backend's in lockstep."""
    lockstep = play(mode, ScriptedEngine(malformed_rate=0.1))
    engine = streaming_engine()
    try:
        got, batch = play(mode, engine)
    finally:
        engine.close()
    assert got.trajectories == reference[0].trajectories
    assert by_env(batch.trajectories) == by_env(lockstep[1].trajectories)
    assert got.metrics["engine/requests"] == got.metrics["engine/calls"]  # one request a message: env-level


@pytest.mark.timeout(120)
def test_env_level_async_false_plays_lockstep_on_a_streaming_engine(reference):
    engine = streaming_engine()
    try:
        with LLMAgentProxy(setup_for(env_level_async=False, use_parallel_rollout=True), engine) as proxy:
            got = proxy.rollout("val", rollout_index=1)
    finally:
        engine.close()
    assert got.trajectories == reference[0].trajectories
    assert got.metrics["engine/requests"] > got.metrics["engine/calls"]  # a request list a stream and turn


def test_env_level_async_true_needs_an_engine_that_streams():
    setup = setup_for(env_level_async=True)
    with pytest.raises(ValueError, match=r"agent_proxy\.env_level_async=true needs an engine that streams.*"
                                         r"engine=openai.*engine 'scripted' answers whole batches"):
        make_backend(setup.agent_proxy, ScriptedEngine())
    with pytest.raises(ValueError, match="agent_proxy.env_level_async must be auto"):
        setup_for(env_level_async="sometimes")


class LosesEnv(StreamingEngine):
    """The scripted policy answering at once, except that it never answers ``lost``'s requests."""

    def __init__(self, lost: int) -> None:
        super().__init__()
        self.inner = ScriptedEngine(malformed_rate=0.1)
        self.lost = lost
        self.kept: list[Future] = []

    def submit(self, requests, sampling):
        futures = []
        for r in requests:
            f: Future = Future()
            if r.env_id == self.lost:
                self.kept.append(f)
            else:
                f.set_result(self.inner.generate([r], sampling)[0])
            futures.append(f)
        return futures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sequential", "loky"])
def test_a_request_never_answered_ends_its_env_in_timeout(mode, reference):
    val = reference[0]
    lost = val.specs[3].env_id
    engine = LosesEnv(lost)
    with LLMAgentProxy(setup_for(engine_timeout_s=1.0, **MODES[mode]), engine) as proxy:
        got = proxy.rollout("val", rollout_index=1)
        deadline = time.monotonic() + 10  # the worker's cancel reaches the manager after the rollout returns
        while not all(f.cancelled() for f in engine.kept) and time.monotonic() < deadline:
            time.sleep(0.01)
    i = next(k for k, s in enumerate(got.specs) if s.env_id == lost)
    assert got.trajectories[i].stop_reason == StopReason.TIMEOUT
    assert "engine_timeout_s=1" in got.trajectories[i].error
    assert [t for k, t in enumerate(got.trajectories) if k != i] == \
        [t for k, t in enumerate(val.trajectories) if k != i]
    assert all(f.cancelled() for f in engine.kept)  # the lost request was dropped, not left running


class AnswersLater(LosesEnv):
    """``LosesEnv``'s answers, set from another thread after ``submit`` returns, as an engine's are."""

    def submit(self, requests, sampling):
        futures = [Future() for _ in requests]

        def answer():
            for f, r in zip(futures, requests):
                if r.env_id == self.lost:
                    self.kept.append(f)
                else:
                    f.set_result(self.inner.generate([r], sampling)[0])

        threading.Timer(0.05, answer).start()
        return futures


@pytest.mark.timeout(60)
def test_the_manager_frees_a_request_list_once_it_is_answered():
    """No reference cycle keeps the manager's record of a request list alive: it
    is freed when answered, timed out or cancelled, not left for a full
    collection (a cycle per request raised the driver's RSS over many
    env-level rollouts, ragen.tools.soak)."""
    engine = AnswersLater(lost=1)
    answered = threading.Event()
    answers = []

    def reply(by_conn):
        answers.extend(a for conn_answers in by_conn.values() for a in conn_answers)
        answered.set()

    streamer = Streamer(engine, EngineGate(), ManagerStats(), reply, request_timeout_s=0.3)
    sampling = SamplingParams()
    kept = []

    def ask(ticket, env_id):
        request = GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up"}], env_id=env_id)
        pending = Pending("conn", ticket, [request], sampling, time.monotonic())
        streamer.submit(pending)
        return weakref.ref(pending)

    def wait_for(n):
        deadline = time.monotonic() + 10
        while len(answers) < n and time.monotonic() < deadline:
            answered.wait(0.1)
            answered.clear()
        assert len(answers) == n

    gc.collect()
    gc.disable()
    try:
        kept = [ask(0, 0), ask(1, 1), ask(2, 1)]  # answered; timed out; cancelled by its worker
        streamer.cancel("conn", 2)
        wait_for(2)
        assert sorted(a["ticket"] for a in answers) == [0, 1] and answers[-1]["timed_out"]
        engine.kept.clear()  # the engine drops the requests it never answered
        ask(3, 0)  # one more answer: the reply thread holds none of the earlier ones now
        wait_for(3)
        assert [ref() for ref in kept] == [None, None, None]
    finally:
        gc.enable()
        streamer.close()


@pytest.mark.timeout(60)
def test_held_requests_share_one_frame():
    engine = streaming_engine()
    manager = SharedLLMInferenceManager(engine)
    try:
        client = manager.client()
        assert client.streams
        sampling = SamplingParams()
        request = GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}])
        client.open_streams(1)  # connects
        before = manager.stats.snapshot().messages_in
        tickets = [client.submit([request], sampling, hold=True) for _ in range(20)]
        for _ in range(5):
            client.close_stream(hold=True)
        client.flush()
        answered = set()
        while len(answered) < len(tickets):
            answered.add(client.wait_any(timeout=30)[0])
        assert answered == set(tickets)
        # 20 requests and 5 closes held for at most shared_client.HOLD_S: a few frames, not 25
        assert manager.stats.snapshot().messages_in - before <= 3
        assert manager.open_streams == 0
    finally:
        manager.close()
        engine.close()


@pytest.mark.timeout(30)
def test_a_weight_swap_waits_for_requests_in_flight_and_holds_new_ones():
    gate = EngineGate()
    events = []
    gate.enter(2)

    def swap():
        with gate:
            events.append("swap")

    t = threading.Thread(target=swap)
    t.start()
    time.sleep(0.1)
    assert events == []  # two requests in flight
    entered = threading.Event()

    def late_request():
        gate.enter()
        events.append("request")
        entered.set()
        gate.leave()

    r = threading.Thread(target=late_request)
    r.start()
    time.sleep(0.1)
    assert not entered.is_set()  # a swap is waiting: new requests wait behind it
    gate.leave(2)
    t.join(10)
    r.join(10)
    assert events == ["swap", "request"]


def test_a_worker_waits_past_the_managers_own_timeout():
    """Where the manager answers a request past engine_timeout_s itself, the worker's wait
    (which starts first) leaves that answer a grace, so the envs end in timeout rather than
    the worker's task in the fallback; elsewhere the worker's wait is engine_timeout_s."""
    from ragen.rollout.backends.parallel import worker_wait_s

    assert worker_wait_s(1.0, manager_times_out=True) == 2.0
    assert worker_wait_s(600.0, manager_times_out=True) == 660.0
    assert worker_wait_s(1.0, manager_times_out=False) == 1.0
    assert worker_wait_s(None, manager_times_out=True) is None


@pytest.mark.timeout(120)
def test_lockstep_turns_on_a_streaming_engine_end_a_lost_request_in_timeout(reference):
    """env_level_async: false: the request list that holds the lost request ends
    in timeout (its envs, not the rollout), the others play on."""
    val = reference[0]
    lost = val.specs[3].env_id
    engine = LosesEnv(lost)
    with LLMAgentProxy(setup_for(engine_timeout_s=1.0, env_level_async=False, use_parallel_rollout=True),
                       engine) as proxy:
        got = proxy.rollout("val", rollout_index=1)
    i = next(k for k, s in enumerate(got.specs) if s.env_id == lost)
    assert got.trajectories[i].stop_reason == StopReason.TIMEOUT
    assert got.metrics["parallel/fallbacks"] == 0
    timed_out = [k for k, t in enumerate(got.trajectories) if t.stop_reason == StopReason.TIMEOUT]
    assert [t for k, t in enumerate(got.trajectories) if k not in timed_out] == \
        [t for k, t in enumerate(val.trajectories) if k not in timed_out]


@pytest.mark.timeout(180)
def test_a_worker_killed_mid_rollout_env_level_loses_nothing(reference, tmp_path):
    """The fallback re-runs the dead worker's groups env-level too, and the dump of
    the rollout replays to the same episodes."""
    from ragen.env.allowed import AllowedEnvTypes
    from ragen.rollout.dump import read_dump, write_dump
    from ragen.tools.replay import replay

    engine = streaming_engine()
    try:
        with LLMAgentProxy(setup_for(**MODES["loky"]), engine) as proxy:
            val = proxy.setup.es["val"].make_specs(1)
            got = proxy.backend.rollout(exiting_group(val, 0, at_step=1, marker=str(tmp_path / "exited")),
                                        proxy.setup.val_loop)
            path = write_dump(tmp_path, "d", got, proxy.setup.val_loop, split="val", step=0)
    finally:
        engine.close()
    assert got.trajectories == reference[0].trajectories
    assert got.metrics["parallel/fallbacks"] + got.metrics["parallel/retried_tasks"] >= 1
    exiting = AllowedEnvTypes(frozenset({"tests.fault_envs:ExitingEnv", "tests.fault_envs:ExitingEnvConfig"}))
    assert all(replay(record, env_types=exiting).identical for record in read_dump(path))
