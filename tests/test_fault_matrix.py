"""Fault matrix of the parallel rollout: one test per way a rollout can break.

Each case runs a rollout with one fault and asserts its outcome (the stop reason
of the faulty group, or the error the rollout raises) AND that no other env's
trajectory is lost or changed: every trajectory but the faulty group's equals
the fault-free run's. Faults: a worker killed (SIGKILL, ``os._exit``), an env
raising in reset or step, an env hanging (``env_timeout_s`` in the loop,
``rollout_timeout_s`` per shard), the engine raising or answering the wrong
number of completions, the engine hanging (the client's ``engine_timeout_s``),
a client disconnecting mid-request, an observation longer than a message may
be (``max_message_bytes``), malformed completions (property-based),
and an env config that does not pickle.

``test_matrix`` crosses the common faults (``FAULT_KINDS``: none, an env
raising, a worker killed, an env hanging past ``env_timeout_s``, the engine
raising once, the engine answering garbage once, an observation over the
frame cap) with every
local backend and Dask, one rollout or two at once on one manager
(``max_concurrent_rollouts: 2``). A new fault kind is one more entry there.
Timeouts are short (0.5-3 s) so the whole file stays under two minutes.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import Completion, Engine, GenerationRequest, SamplingParams
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.rollout.workers.cluster import ClusterConfig
from ragen.rollout.backends.parallel import ParallelRolloutManager, ParallelSettings, RolloutError
from ragen.serving import DirectClient
from ragen.rollout.scheduler import KeptEnvs, run_envs
from ragen.serving import SharedLLMInferenceManager
from ragen.rollout.types import StopReason

from tests.rollout_helpers import custom_envs, fault_tag, loop_config, rollouts_at_once, sequential, specs_for

ROOT = Path(__file__).resolve().parents[1]
N_GROUPS, GROUP_SIZE, BAD = 6, 2, 2  # group BAD (env_ids 4, 5) carries the fault
CAP = 1 << 20  # the managers' max_message_bytes where an observation passes it: a small cap keeps them light


# ----- helpers ------------------------------------------------------------------

def _strip(trajs):
    return [(t.env_id, t.stop_reason, t.error, [(x.response, x.executed_actions, x.reward) for x in t.turns])
            for t in trajs]


def fault_specs(fault="none", transient_marker="", **kw):
    clean = specs_for(["Fault"], [N_GROUPS], GROUP_SIZE, custom_envs(Fault=fault_tag()))
    bad_seed = next(s.seed for s in clean if s.group_id == BAD)
    tag = fault_tag(fault, fault_seed=bad_seed, marker=transient_marker, **kw)
    return clean, specs_for(["Fault"], [N_GROUPS], GROUP_SIZE, custom_envs(Fault=tag))


@pytest.fixture(scope="module")
def dask_address():
    """A local Dask cluster reached by address: 2 single-threaded worker
    processes, one retry of a task whose worker died (as the README advises)."""
    pytest.importorskip("distributed")
    import dask
    from distributed import LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 1}):
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                               host="127.0.0.1")
    yield cluster.scheduler_address
    cluster.close()


def cluster_for(backend: str, request) -> ClusterConfig | None:
    if backend != "dask":
        return None
    return ClusterConfig(dask_scheduler_address=request.getfixturevalue("dask_address"))


@pytest.fixture(scope="module")
def reference():
    """The fault-free rollout, sequential (the reference of every case)."""
    clean, _ = fault_specs()
    return sequential(clean, loop_config(), ScriptedEngine())


def assert_only_bad_group_hit(result, reference, reasons, error_has=""):
    """The faulty group ends with one of ``reasons``; every other trajectory is the fault-free one."""
    assert [t.env_id for t in result.trajectories] == [t.env_id for t in reference]  # nothing lost
    for got, want in zip(result.trajectories, reference):
        if got.group_id == BAD and not (want.num_actions == 0 and _strip([got]) == _strip([want])):
            # (an env the policy never stepped cannot meet a fault in step: it is the fault-free one)
            assert got.stop_reason in reasons, got
            assert got.error and error_has in got.error, got.error
        else:
            assert _strip([got]) == _strip([want])


class FaultyEngine(ScriptedEngine):
    """The scripted policy with an injected fault on its next ``times`` calls (None: every call)."""

    def __init__(self, mode: str | None = None, times: int | None = None, hang_s: float = 3.0, **kw) -> None:
        super().__init__(**kw)
        self.mode, self.times, self.hang_s = mode, times, hang_s
        self.calls = 0

    def generate(self, requests, sampling):
        self.calls += 1
        if self.mode and (self.times is None or self.times > 0):
            if self.times is not None:
                self.times -= 1
            if self.mode == "raise":
                raise RuntimeError("injected engine failure")
            if self.mode == "hang":
                time.sleep(self.hang_s)
            if self.mode == "short":
                return super().generate(requests, sampling)[:-1]
            if self.mode == "garbage":  # dicts, not Completions
                return [{"text": c.text} for c in super().generate(requests, sampling)]
        return super().generate(requests, sampling)


def recovered(result) -> float:
    """Shards the rollout re-ran: sequential fallbacks and parallel retries (after a dead worker)."""
    return result.metrics["parallel/fallbacks"] + result.metrics.get("parallel/retried_tasks", 0.0)


def open_streams(shared: SharedLLMInferenceManager, within_s: float = 2.0) -> int:
    """The streams the manager counts open, once the close messages sent before
    now have arrived (they travel apart from the results): 0, or what is left
    after ``within_s``."""
    deadline = time.monotonic() + within_s
    while shared.open_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    return shared.open_streams


def wait_engine_idle(shared: SharedLLMInferenceManager) -> None:
    with shared.engine_lock:  # a call still running (a hang) has finished
        pass


# ----- the matrix: backend x rollouts at once x fault -----------------------------

@dataclass(frozen=True)
class FaultKind:
    """One way a rollout can break, as the matrix injects it.

    ``env_fault`` (``FaultEnv``'s ``fault``, with ``env_kw``) hits group BAD.
    A ``transient`` fault fails its first time only: every rollout must be the
    fault-free one. Otherwise group BAD ends with one of ``reasons`` and every
    other trajectory is the fault-free one. ``engine`` builds the engine the
    shared manager serves for the case: the engine's faults (raising once,
    answering garbage once) are kinds with a faulty engine and no env fault.
    """

    env_fault: str = "none"
    env_kw: tuple = ()
    transient: bool = False
    reasons: frozenset = frozenset()
    error_has: str = ""  # in the error of group BAD's trajectories
    kills_worker: bool = False  # not on threading and sequential: the worker is the test process
    loop_kw: tuple = ()
    engine: Callable[[], Engine] = ScriptedEngine


FAULT_KINDS = {
    "none": FaultKind(),
    "env_raises": FaultKind("raise_step", reasons=frozenset({StopReason.ERROR}), error_has="injected"),
    "worker_killed": FaultKind("kill_step", transient=True, kills_worker=True),
    "env_hangs": FaultKind("hang_step", env_kw=(("hang_s", 2.0),), reasons=frozenset({StopReason.TIMEOUT}),
                           error_has="longer than 0.5 s", loop_kw=(("env_timeout_s", 0.5),)),
    "engine_raises_once": FaultKind(transient=True, engine=lambda: FaultyEngine("raise", times=1)),
    "engine_garbage_once": FaultKind(transient=True, engine=lambda: FaultyEngine("garbage", times=1)),
    "obs_over_frame_cap": FaultKind("huge_step", env_kw=(("huge_bytes", 2 * CAP),),
                                    reasons=frozenset({StopReason.ERROR}), error_has="agent_proxy.max_message_bytes"),
}
MATRIX_BACKENDS = ["loky", "threading", "multiprocessing", "sequential", "dask"]


@pytest.fixture(scope="module", params=MATRIX_BACKENDS)
def matrix_manager(request):
    """One shared manager and rollout manager per backend for all its cases
    (workers start once); each case checks that it leaves them working."""
    backend = request.param
    with SharedLLMInferenceManager(ScriptedEngine(), max_message_bytes=CAP) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend=backend, fallback_env_timeout_s=2),
                                   cluster=cluster_for(backend, request)) as prm:
        yield backend, shared, prm


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", list(FAULT_KINDS))
@pytest.mark.parametrize("at_once", [1, 2])
def test_matrix(matrix_manager, at_once, fault, reference, tmp_path):
    """Every rollout returns, with one trajectory per env in env_id order: the
    fault-free ones, but for an error or timeout of the group at fault."""
    backend, shared, prm = matrix_manager
    kind = FAULT_KINDS[fault]
    if kind.kills_worker and backend in ("threading", "sequential"):
        pytest.skip(f"the {backend} backend's worker is this process")
    _, specs = fault_specs(kind.env_fault, transient_marker=str(tmp_path / "marker") if kind.transient else "",
                           **dict(kind.env_kw))
    with shared.engine_lock:
        shared.engine = kind.engine()
    results = rollouts_at_once(prm, at_once, specs, loop_config(**dict(kind.loop_kw)), within_s=60)
    for result in results:
        if kind.env_fault == "none" or kind.transient:
            assert _strip(result.trajectories) == _strip(reference)
        else:
            assert_only_bad_group_hit(result, reference, kind.reasons, kind.error_has)
        if fault == "none":
            assert recovered(result) == 0
    if isinstance(shared.engine, FaultyEngine):
        assert shared.engine.times == 0  # the engine's fault was met
    assert open_streams(shared) == 0  # nothing left for the coalescer to wait for


# ----- workers killed -----------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["kill_step", "exit_step"])
def test_worker_killed_every_time_ends_only_its_group(reference, fault):
    _, faulty = fault_specs(fault)
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, fallback_env_timeout_s=2)) as prm:
        result = prm.rollout(faulty, loop_config())
        assert recovered(result) >= 1
        assert_only_bad_group_hit(result, reference, {StopReason.ERROR}, "worker process failed")
        # the executor is rebuilt: the next fault-free rollout is parallel again, no fallback
        clean, _ = fault_specs()
        again = prm.rollout(clean, loop_config())
        assert again.metrics["parallel/fallbacks"] == 0 and _strip(again.trajectories) == _strip(reference)


@pytest.mark.timeout(60)
def test_worker_sigkilled_on_multiprocessing_with_a_rollout_timeout(reference):
    """A worker of the multiprocessing backend killed on every try, with a
    rollout_timeout_s set: the rollout returns, only the faulty group hit."""
    _, faulty = fault_specs("kill_step")
    t0 = time.monotonic()
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="multiprocessing", rollout_timeout_s=2,
                                   fallback_env_timeout_s=2)) as prm:
        result = prm.rollout(faulty, loop_config())
        assert time.monotonic() - t0 < 30
        assert_only_bad_group_hit(result, reference, {StopReason.ERROR})
        clean, _ = fault_specs()
        assert _strip(prm.rollout(clean, loop_config()).trajectories) == _strip(reference)


@pytest.fixture(scope="module")
def proxy_reference():
    """The fault-free rollout of ``proxy_config``, by the sequential proxy."""
    with LLMAgentProxy(AgentSetup.from_config(proxy_config(fault_tag(), use_parallel_rollout=False)),
                       ScriptedEngine()) as proxy:
        return proxy.rollout("train", rollout_index=0).trajectories


@pytest.mark.timeout(90)
def test_worker_killed_through_the_agent_proxy(proxy_reference):
    """AgentSetup.from_config with a plain dict, LLMAgentProxy, a SIGKILL in one worker."""
    clean, _ = fault_specs()
    bad_seed = next(s.seed for s in clean if s.group_id == BAD)
    cfg = proxy_config(fault_tag("kill_step", fault_seed=bad_seed))
    with LLMAgentProxy(AgentSetup.from_config(cfg), ScriptedEngine()) as proxy:
        result = proxy.rollout("train", rollout_index=0)
    assert recovered(result) >= 1
    assert_only_bad_group_hit(result, proxy_reference, {StopReason.ERROR})


def proxy_config(tag: dict, **agent_proxy) -> dict:
    return {
        "custom_envs": custom_envs(Fault=tag),
        "seed": {"train": 7, "val": 123},
        "agent_proxy": {"use_parallel_rollout": True, "parallel_n_jobs": 2, "max_turn": 4,
                        "max_actions_per_turn": 3, "pipeline_depth": 1, "fallback_to_sequential": True,
                        **agent_proxy},
        "ctx_manager": {"generation": {"response_length": 64}},
        "es_manager": {
            "format_penalty": -0.1,
            "train": {"env_groups": N_GROUPS, "group_size": GROUP_SIZE,
                      "env_configs": {"tags": ["Fault"], "n_groups": [N_GROUPS]}},
            "val": {"env_groups": 1, "group_size": 1, "env_configs": {"tags": ["Fault"], "n_groups": [1]}},
        },
    }


# ----- envs raising -------------------------------------------------------------

@pytest.mark.timeout(60)
def test_env_raising_in_reset_ends_only_its_group_in_error(reference):
    """(An env raising in step: the matrix.)"""
    _, faulty = fault_specs("raise_reset")
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        result = prm.rollout(faulty, loop_config())
    # retried alone in its worker, then ended in error there: no shard re-run
    assert result.metrics["parallel/fallbacks"] == 0 and result.metrics["rollout/env_retries"] >= 1
    assert_only_bad_group_hit(result, reference, {StopReason.ERROR}, "injected")


# ----- envs hanging -------------------------------------------------------------

# (an env hanging past env_timeout_s: the matrix)

@pytest.mark.timeout(60)
def test_env_hanging_with_rollout_timeout(reference):
    _, faulty = fault_specs("hang_step", hang_s=6.0)
    t0 = time.monotonic()
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, rollout_timeout_s=2,
                                   fallback_env_timeout_s=1)) as prm:
        result = prm.rollout(faulty, loop_config())
        assert result.metrics["parallel/fallbacks"] >= 1
        assert_only_bad_group_hit(result, reference, {StopReason.TIMEOUT})
        assert time.monotonic() - t0 < 25
        clean, _ = fault_specs()
        assert _strip(prm.rollout(clean, loop_config()).trajectories) == _strip(reference)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["threading", "dask"])
def test_shard_past_rollout_timeout_stops_being_waited_for(reference, backend, request):
    """A shard past rollout_timeout_s in a thread or a Dask task cannot be
    stopped; it kept its streams open in the shared manager, and every later
    engine call waited out the whole coalescing budget for them. The rollout
    withdraws them: the manager counts no open stream once it returns, while
    the abandoned shard still sleeps in its env."""
    _, faulty = fault_specs("hang_step", hang_s=8.0)
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend=backend, rollout_timeout_s=1.5,
                                   fallback_env_timeout_s=1), cluster=cluster_for(backend, request)) as prm:
        result = prm.rollout(faulty, loop_config())
        assert result.metrics["parallel/fallbacks"] >= 1
        assert_only_bad_group_hit(result, reference, {StopReason.TIMEOUT})
        assert open_streams(shared) == 0  # the abandoned shard sleeps on (hang_s) past this check
        clean, _ = fault_specs()
        assert _strip(prm.rollout(clean, loop_config()).trajectories) == _strip(reference)
        assert open_streams(shared) == 0


# ----- the engine failing -------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,message", [("raise", "injected engine failure"),
                                          ("short", "completions for")])
def test_engine_failing_every_call_raises_a_clear_error(reference, mode, message):
    engine = FaultyEngine(mode)
    clean, _ = fault_specs()
    t0 = time.monotonic()
    with SharedLLMInferenceManager(engine) as shared, ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        with pytest.raises(RolloutError) as info:
            prm.rollout(clean, loop_config())
        text = str(info.value)
        assert "worker task" in text and "fallback" in text and message in text and "EngineError" in text
        assert time.monotonic() - t0 < 20
        engine.mode = None  # the engine recovers: the manager and executor still work
        assert _strip(prm.rollout(clean, loop_config()).trajectories) == _strip(reference)


@pytest.mark.timeout(60)
def test_engine_failing_once_is_absorbed_by_the_fallback(reference):
    engine = FaultyEngine("raise", times=1)
    clean, _ = fault_specs()
    with SharedLLMInferenceManager(engine) as shared, ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        result = prm.rollout(clean, loop_config())
    assert result.metrics["parallel/fallbacks"] >= 1
    assert _strip(result.trajectories) == _strip(reference)


@pytest.mark.timeout(60)
def test_engine_hanging_hits_engine_timeout_through_the_proxy(proxy_reference):
    engine = FaultyEngine("hang", hang_s=2.5)
    cfg = proxy_config(fault_tag(), engine_timeout_s=1.0)
    t0 = time.monotonic()
    with LLMAgentProxy(AgentSetup.from_config(cfg), engine) as proxy:
        with pytest.raises(RolloutError, match=r"no answer from the LLM manager within 1\.0 s"):
            proxy.rollout("train", rollout_index=0)
        assert time.monotonic() - t0 < 25
        engine.mode = None
        wait_engine_idle(proxy.shared)
        assert _strip(proxy.rollout("train", rollout_index=0).trajectories) == _strip(proxy_reference)


# ----- an observation over the frame cap ------------------------------------------

@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["loky", "threading"])
def test_observation_over_the_frame_cap_fails_only_its_env(reference, backend):
    """An env's observation of twice the cap made a message the manager
    refused: it closed the connection, the shard failed, the fallback failed
    on the same message (BrokenPipeError) and every trajectory was lost. The
    sender checks the size first: that env ends in error, naming the size,
    the limit and the key; the others complete, with no fallback."""
    _, faulty = fault_specs("huge_step", huge_bytes=2 * CAP)
    with SharedLLMInferenceManager(ScriptedEngine(), max_message_bytes=CAP) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend=backend,
                                   fallback_env_timeout_s=2)) as prm:
        result = prm.rollout(faulty, loop_config())
        assert_only_bad_group_hit(result, reference, {StopReason.ERROR}, "agent_proxy.max_message_bytes")
        bad = [t for t in result.trajectories if t.group_id == BAD and t.stop_reason == StopReason.ERROR]
        assert bad and all(f"limit of {CAP} bytes" in t.error for t in bad)
        assert result.metrics["parallel/fallbacks"] == 0
        assert open_streams(shared) == 0
        clean, _ = fault_specs()  # the connections and workers still serve
        assert _strip(prm.rollout(clean, loop_config()).trajectories) == _strip(reference)


@pytest.mark.timeout(90)
def test_max_message_bytes_is_read_from_agent_proxy(proxy_reference):
    clean, _ = fault_specs()
    bad_seed = next(s.seed for s in clean if s.group_id == BAD)
    cfg = proxy_config(fault_tag("huge_step", fault_seed=bad_seed, huge_bytes=2 * CAP), max_message_bytes=CAP)
    with LLMAgentProxy(AgentSetup.from_config(cfg), ScriptedEngine()) as proxy:
        assert proxy.shared.max_message_bytes == CAP
        result = proxy.rollout("train", rollout_index=0)
    assert_only_bad_group_hit(result, proxy_reference, {StopReason.ERROR}, f"limit of {CAP} bytes")


def leave_an_answer_unread(shared: SharedLLMInferenceManager) -> None:
    """This thread's connection to ``shared`` out of step, as a failure can leave it: open,
    with the answer to a request of its own waiting unread."""
    client = shared.client()
    client.open_streams(1)
    client.submit([GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}])],
                  SamplingParams())
    client.close_stream()
    deadline = time.monotonic() + 10
    while not client.ready() and time.monotonic() < deadline:  # the answer is here, not read
        time.sleep(0.02)
    assert client.ready()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["threading", "loky"])
def test_connections_the_manager_closed_are_not_reused(reference, backend):
    """Workers and the in-process fallback keep their connection between
    rollouts: one the manager closed meanwhile (a frame it refused) failed
    the next shard, and then the fallback on the same dead socket
    (BrokenPipeError). A shard starts on a live connection (a worker that
    kept its own from a rollout with no fallback too), and the fallback on
    a fresh one (on threading it runs in this thread, whose connection is
    left out of step, not closed, before the first rollout)."""
    clean, _ = fault_specs()
    with SharedLLMInferenceManager(FaultyEngine("raise", times=0)) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend=backend)) as prm:
        leave_an_answer_unread(shared)
        # a fallback (in the driver on threading, which keeps its connection) or none; a rollout
        # with no fallback after one with none: the workers' connections were kept and closed since
        for times in (1, 1, 0, 0):
            shared.engine.times = times
            result = prm.rollout(clean, loop_config())
            assert _strip(result.trajectories) == _strip(reference)
            assert (result.metrics["parallel/fallbacks"] > 0) == (times > 0), times
            with shared._cond:  # the manager drops every connection
                conns = list(shared._conns)
            for c in conns:
                c.sock.shutdown(socket.SHUT_RDWR)
            deadline = time.monotonic() + 10
            while shared._conns and time.monotonic() < deadline:
                time.sleep(0.02)


# ----- clients disconnecting ----------------------------------------------------

_DYING_CLIENT = """
import pickle, sys, time
from ragen.llm.types import GenerationRequest, SamplingParams
client = pickle.loads(sys.stdin.buffer.read())
client.open_streams(3)
client.submit([GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}])],
              SamplingParams())
print("sent", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_clients_disconnecting_mid_request_leave_the_manager_working(reference):
    engine = ScriptedEngine(base_s=0.5)  # requests stay in flight long enough to abandon them
    clean, _ = fault_specs()
    with SharedLLMInferenceManager(engine) as shared, ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        # a process killed (SIGKILL) while its request is in flight, with streams open
        proc = subprocess.Popen([sys.executable, "-c", _DYING_CLIENT], cwd=ROOT, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
        proc.stdin.write(pickle.dumps(shared.client()))
        proc.stdin.close()
        assert proc.stdout.readline().strip() == b"sent"
        time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # a thread's client that drops its connection before the answer
        client = shared.client()
        client.submit([GenerationRequest(messages=[{"role": "user", "content": "x"}])], SamplingParams())
        client.reset()
        # a peer that is not a client: wrong key, then a half-open connection
        with socket.create_connection(shared.address) as s:
            s.recv(64)
            s.sendall(b"\0" * 32)
            s.recv(64)
        socket.create_connection(shared.address).close()
        deadline = time.monotonic() + 5
        while shared.open_streams and time.monotonic() < deadline:  # the dead client's streams are released
            time.sleep(0.05)
        assert shared.open_streams == 0
        assert shared.stats.refused_clients >= 1
        engine.base_s = 0.0
        result = prm.rollout(clean, loop_config())
        assert result.metrics["parallel/fallbacks"] == 0
        assert _strip(result.trajectories) == _strip(reference)


# ----- malformed completions ----------------------------------------------------

class TextEngine(Engine):
    """Answers each request with one of ``texts``, picked by (env_id, turn)."""

    name = "texts"

    def __init__(self, texts: list[str]) -> None:
        super().__init__()
        self.texts = texts

    def generate(self, requests, sampling):
        return [Completion(text=self.texts[(r.env_id * 7 + r.turn) % len(self.texts)], prompt_token_ids=[],
                           response_token_ids=[], finish_reason="stop", policy_version=self.policy_version,
                           env_id=r.env_id, turn=r.turn) for r in requests]


ACTION_WORDS = ["Up", "Down", "Left", "Right", "up", "DOWN", "Jump", "owl", "Trader", "Explorer", "1 + 2", "", " ", "||",
                "<answer>", "</answer>", "<think>", "</think>", "<|im_end|>", "\x00", "🙂", "\n"]
answers = st.builds(
    lambda think, acts, sep, close: f"<think>{think}</think><answer>{sep.join(acts)}" + ("</answer>" if close else ""),
    st.text(max_size=40), st.lists(st.sampled_from(ACTION_WORDS), max_size=12),
    st.sampled_from(["||", " || ", "|", ",", "||||"]), st.booleans())
completion_texts = st.lists(st.one_of(st.text(max_size=200), answers), min_size=1, max_size=6)
MIXED_TAGS, MIXED_GROUPS = ["SimpleSokoban", "FrozenLake", "Bandit", "Countdown", "Fault"], [1, 1, 1, 1, 1]
NASTY = ["", "\x00" * 50, "<answer>" * 2000, "<think>" * 5000 + "<answer>Up</answer>", "🙂" * 3000,
         "<think></think><answer>" + "Up || " * 5000 + "</answer>", "<answer>Up</answer>" * 100,
         "</answer><answer>", "\ufffd" * 10 + "<answer>Down</answer>"]


@pytest.fixture(scope="module")
def mixed_specs():
    envs = custom_envs(Fault=fault_tag())
    # a config of its own: loky's workers outlive a manager, and other test files count the envs they build
    envs["Bandit"] = {**envs["Bandit"], "env_config": {"split": "test", "hi_arm_hiscore_prob": 0.3}}
    return specs_for(MIXED_TAGS, MIXED_GROUPS, 2, envs)


def assert_one_sane_trajectory_each(trajectories, specs, max_turn):
    assert [t.env_id for t in trajectories] == [s.env_id for s in specs]
    for t in trajectories:
        assert t.stop_reason in (StopReason.DONE, StopReason.MAX_TURNS, StopReason.ACTION_BUDGET), (t.stop_reason,
                                                                                                    t.error)
        assert 1 <= len(t.turns) <= max_turn


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=completion_texts)
def test_arbitrary_completions_never_break_the_loop(mixed_specs, texts):
    config = loop_config(max_turn=3)
    trajectories, _ = run_envs(mixed_specs, DirectClient(TextEngine(texts)), config, kept_envs=KeptEnvs(),
                               isolate_errors=True)
    assert_one_sane_trajectory_each(trajectories, mixed_specs, 3)


@pytest.fixture(scope="module")
def wire():
    """A manager whose engine answers from a mutable list, reached over its socket."""
    engine = TextEngine(["x"])
    with SharedLLMInferenceManager(engine, coalesce_wait_s=0.0) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=1, backend="sequential")) as prm:
        yield engine, prm


@pytest.mark.timeout(120)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=completion_texts)
def test_arbitrary_completions_over_the_wire(wire, mixed_specs, texts):
    engine, prm = wire
    engine.texts = texts
    result = prm.rollout(mixed_specs, loop_config(max_turn=3))
    assert_one_sane_trajectory_each(result.trajectories, mixed_specs, 3)
    assert result.metrics["parallel/fallbacks"] == 0
    # the texts arrive as they were generated
    assert all(turn.response in texts for t in result.trajectories for turn in t.turns)


@pytest.mark.timeout(60)
def test_nasty_completions_in_worker_processes(mixed_specs):
    engine = TextEngine(NASTY)
    ref = sequential(mixed_specs, loop_config(max_turn=3), engine)
    assert_one_sane_trajectory_each(ref, mixed_specs, 3)
    with SharedLLMInferenceManager(engine) as shared, ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        result = prm.rollout(mixed_specs, loop_config(max_turn=3))
    assert result.metrics["parallel/fallbacks"] == 0
    assert _strip(result.trajectories) == _strip(ref)


# ----- an env config that does not pickle ---------------------------------------

def unpicklable_specs():
    envs = custom_envs(My={"env_type": "tests.custom_env_example:MyEnv", "env_config": {"limit": 3}})
    specs = specs_for(["My"], [4], 2, envs)
    return [replace(s, env_config={"limit": 3, "hook": threading.Lock()}) for s in specs]


@pytest.mark.timeout(60)
def test_unpicklable_env_config_fails_fast_on_a_process_backend():
    """The rollout raises at once, naming the key (no hang, nothing half-done)."""
    t0 = time.monotonic()
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        with pytest.raises(Exception, match="pickle"):
            prm.rollout(unpicklable_specs(), loop_config())
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_unpicklable_env_config_is_fine_on_threads():
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="threading")) as prm:
        result = prm.rollout(unpicklable_specs(), loop_config())
    assert len(result.trajectories) == 8 and result.metrics["parallel/fallbacks"] == 0


@pytest.mark.timeout(60)
def test_unpicklable_env_config_on_threads_falls_back_in_this_process(reference):
    """The fallback of the threading backend runs where its shards ran: a
    config that does not pickle (what threading is for) is no reason to fail
    the rollout. The shards fail through the engine (an env raising no longer
    fails its shard: it is retried and ends in error alone)."""
    clean, _ = fault_specs()
    specs = [replace(s, env_config={**s.env_config, "hook": threading.Lock()}) for s in clean]
    with SharedLLMInferenceManager(FaultyEngine("raise", times=1)) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend="threading")) as prm:
        result = prm.rollout(specs, loop_config())
    assert result.metrics["parallel/fallbacks"] >= 1
    assert _strip(result.trajectories) == _strip(reference)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["threading", "sequential"])
def test_env_registered_in_the_driver_falls_back_in_this_process(reference, backend):
    """An env registered with register_env exists in the driver only; the
    fallback of an in-process backend must not send it to another process,
    where every env of the shard failed as unknown."""
    from ragen.env import register_env
    from tests.fault_envs import FaultEnv, FaultEnvConfig

    register_env("fault_registered_in_driver", FaultEnv, FaultEnvConfig)
    clean, _ = fault_specs()
    bad_seed = next(s.seed for s in clean if s.group_id == BAD)
    tag = {**fault_tag("raise_step", fault_seed=bad_seed), "env_type": "fault_registered_in_driver",
           "config_type": None}
    faulty = specs_for(["Fault"], [N_GROUPS], GROUP_SIZE, custom_envs(Fault=tag))
    # the engine failing once fails the shards; the env raising is retried and ends in error alone
    with SharedLLMInferenceManager(FaultyEngine("raise", times=1)) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2, backend=backend)) as prm:
        result = prm.rollout(faulty, loop_config())
    assert result.metrics["parallel/fallbacks"] >= 1
    assert_only_bad_group_hit(result, reference, {StopReason.ERROR}, "injected")


@pytest.mark.timeout(60)
def test_unpicklable_env_config_error_names_the_tag_and_key():
    with SharedLLMInferenceManager(ScriptedEngine()) as shared, \
            ParallelRolloutManager(shared, ParallelSettings(n_jobs=2)) as prm:
        with pytest.raises(Exception) as info:
            prm.rollout(unpicklable_specs(), loop_config())
    assert "custom_envs.My.env_config.hook" in str(info.value)


@pytest.mark.timeout(60)
def test_unpicklable_env_config_through_the_proxy_is_a_clear_error():
    cfg = proxy_config(fault_tag())
    cfg["custom_envs"]["My"] = {"env_type": "tests.custom_env_example:MyEnv",
                                "env_config": {"limit": 3, "hook": threading.Lock()}}
    cfg["es_manager"]["train"]["env_configs"] = {"tags": ["My"], "n_groups": [N_GROUPS]}
    with pytest.raises(Exception) as info:  # at start-up (from_config) or at the first rollout
        with LLMAgentProxy(AgentSetup.from_config(cfg), ScriptedEngine()) as proxy:
            proxy.rollout("train")
    assert "custom_envs.My.env_config.hook" in str(info.value)


# ----- the driver terminated ----------------------------------------------------

@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["loky", "multiprocessing"])
def test_driver_sigterm_leaves_no_process_behind(backend):
    """A driver (a library user's script, no SIGTERM handler) terminated
    mid-rollout, one worker stuck in a long env step: every worker and
    resource tracker of its tree ends with it (tests/test_process_lifecycle.py
    has SIGKILL, os._exit and train.py's SIGTERM handler)."""
    from tests.test_process_lifecycle import assert_all_gone, busy_driver

    proc, tree = busy_driver(backend)
    os.kill(proc.pid, signal.SIGTERM)
    assert_all_gone(proc, tree, expect_rc={-signal.SIGTERM})
