"""The turn loop with no barrier between envs (``run_envs(..., batching=EnvLevel())``)
on an engine that batches continuously: each env takes its next turn as soon
as its own answer is in, and the trajectories are the lockstep loop's."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import StreamingEngine
from ragen.rollout.batching import EnvLevel, Lockstep
from ragen.rollout.scheduler import KeptEnvs, run_envs
from ragen.serving import DirectClient, StreamingDirectClient, direct_client

from tests.rollout_helpers import custom_envs, fault_tag, loop_config, specs_for, streaming_engine


@pytest.mark.timeout(120)
def test_env_level_gives_the_lockstep_trajectories():
    envs = custom_envs(Broken=fault_tag("raise_step", fault_seed=18))  # a group that raises: each ends in error alone
    specs = specs_for(["SimpleSokoban", "FrozenLake", "Bandit", "Broken"], [4, 4, 2, 2], 3, envs, seed=7)
    config = loop_config(max_turn=4)
    reference, _ = run_envs(specs, DirectClient(ScriptedEngine(malformed_rate=0.1)), config, kept_envs=KeptEnvs())
    assert any(t.error for t in reference)
    engine = streaming_engine()
    try:
        for env_level, depth in ((True, 1), (False, 1), (False, 2)):
            batching = EnvLevel() if env_level else Lockstep(depth=depth)
            got, stats = run_envs(specs, direct_client(engine), config, kept_envs=KeptEnvs(), batching=batching)
            assert got == reference, (env_level, depth)
            assert [[t.logprobs for t in tr.turns] for tr in got] == [[t.logprobs for t in tr.turns] for tr in reference]
            if env_level:  # one request an env and turn
                assert stats.requests == stats.submits == sum(len(t.turns) for t in got) + sum(
                    1 for t in got if t.failed_response is not None)
    finally:
        engine.close()


class GatedEngine(StreamingEngine):
    """The scripted policy, answering at once, except env ``held``'s
    requests: held until env ``until[0]`` has asked for its turn ``until[1]``.
    A loop that waits for every env's answer would wait for ever; after
    ``release_s`` the held answers are given anyway, so that such a loop ends
    and fails on the order of ``asked`` rather than on the test's timeout."""

    def __init__(self, held: int, until: tuple[int, int], release_s: float = 10.0) -> None:
        super().__init__()
        self.inner = ScriptedEngine()
        self.held_env, self.until = held, until
        self.held: list[tuple[Future, object, object]] = []
        self.released = False
        self.asked: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        self.timer = threading.Timer(release_s, self.release)
        self.timer.daemon = True
        self.timer.start()

    def submit(self, requests, sampling):
        futures = []
        for r in requests:
            self.asked.append((r.env_id, r.turn))
            f: Future = Future()
            futures.append(f)
            with self.lock:
                hold = r.env_id == self.held_env and not self.released
                if hold:
                    self.held.append((f, r, sampling))
            if not hold:
                f.set_result(self.inner.generate([r], sampling)[0])
            if (r.env_id, r.turn) == self.until:
                self.release()
        return futures

    def release(self) -> None:
        with self.lock:
            self.released, held, self.held = True, self.held, []
        for f, r, s in held:
            f.set_result(self.inner.generate([r], s)[0])

    def asked_before(self, env_id: int, turn: int) -> list[tuple[int, int]]:
        """The requests the engine was asked for before env_id's request of ``turn``."""
        key = (env_id, turn)
        return self.asked[:self.asked.index(key)] if key in self.asked else list(self.asked)

    def close(self) -> None:
        self.timer.cancel()
        self.release()


@pytest.mark.timeout(60)
def test_an_env_plays_on_while_another_waits_for_its_answer():
    specs = specs_for(["FrozenLake"], [2], 1, custom_envs(), seed=3)
    config = loop_config(max_turn=4)
    reference, _ = run_envs(specs, DirectClient(ScriptedEngine()), config, kept_envs=KeptEnvs())
    env1_turns = len(reference[1].turns)
    assert env1_turns >= 2
    engine = GatedEngine(held=0, until=(1, env1_turns - 1))
    try:
        got, _ = run_envs(specs, StreamingDirectClient(engine), config, kept_envs=KeptEnvs(), batching=EnvLevel())
    finally:
        engine.close()
    assert got == reference
    # env 1 asked for every one of its turns while env 0's first answer was still held
    assert [k for k in engine.asked_before(0, 1) if k[0] == 1] == [(1, t) for t in range(env1_turns)]


@pytest.mark.timeout(60)
def test_the_streaming_client_answers_tickets_as_they_finish():
    engine = streaming_engine(tokens_sigma=0.0, tokens_median=5)
    try:
        client = direct_client(engine)
        assert isinstance(client, StreamingDirectClient) and isinstance(direct_client(ScriptedEngine()), DirectClient)
        specs = specs_for(["FrozenLake"], [3], 1, custom_envs())
        from ragen.llm.types import GenerationRequest

        requests = [GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}],
                                      env_id=s.env_id, turn=0, seed=s.seed) for s in specs]
        tickets = [client.submit([r], loop_config().sampling) for r in requests]
        answered = [client.wait_any()[0] for _ in tickets]
        assert sorted(answered) == tickets and not client.ready()
        with pytest.raises(RuntimeError, match="no request in flight"):  # never an endless wait on nothing
            client.wait_any()
        assert client.engine_calls == 3 and client.batch_sizes == [1, 1, 1] and client.engine_time_s > 0
    finally:
        engine.close()
    with pytest.raises(TypeError, match="does not stream"):
        StreamingDirectClient(ScriptedEngine())


class HandEngine(StreamingEngine):
    """A streaming engine whose futures the test resolves, one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ScriptedEngine()
        self.futures: list[tuple[Future, object, object]] = []

    def submit(self, requests, sampling):
        new = [(Future(), r, sampling) for r in requests]
        self.futures += new
        return [f for f, _, _ in new]

    def finish(self, i: int) -> None:
        f, r, s = self.futures[i]
        f.set_result(self.inner.generate([r], s)[0])

    def close(self) -> None:
        for i, (f, _, _) in enumerate(self.futures):
            if not f.done():
                self.finish(i)


@pytest.mark.timeout(60)
def test_the_streaming_client_answers_the_ticket_that_finished_first():
    """Tickets are answered in the order they finish, not the order they were submitted."""
    from ragen.llm.types import GenerationRequest

    engine = HandEngine()
    client = StreamingDirectClient(engine)
    sampling = loop_config().sampling
    tickets = [client.submit([GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down"}],
                                                env_id=i, turn=0, seed=1)], sampling) for i in range(3)]
    try:
        assert not client.ready()
        for i in (2, 0, 1):
            engine.finish(i)
            assert client.ready()
            # the answer is already here: the wait's limit only ends a client that waits for an earlier ticket
            answer = client.wait_any(timeout=5)
            assert answer is not None and answer[0] == tickets[i] and answer[1][0].text, (i, answer)
        assert not client.ready()
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_env_level_takes_chunks_from_a_queue():
    """Pull-based work: each chunk taken plays env by env, with the lockstep loop's trajectories."""
    specs = specs_for(["SimpleSokoban", "FrozenLake", "Bandit"], [3, 3, 2], 2, custom_envs(), seed=3)
    config = loop_config(max_turn=3)
    reference, _ = run_envs(specs, DirectClient(ScriptedEngine(malformed_rate=0.1)), config, kept_envs=KeptEnvs())
    chunks = [specs[i: i + 4] for i in range(4, len(specs), 4)]
    engine = streaming_engine()
    try:
        got, stats = run_envs(specs[:4], StreamingDirectClient(engine), config, kept_envs=KeptEnvs(),
                              batching=EnvLevel(max_live_envs=6), take=lambda: chunks.pop(0) if chunks else [])
    finally:
        engine.close()
    assert got == reference and stats.chunks == 3
    assert stats.requests == stats.submits  # one request an env and turn, never a chunk's together


@pytest.mark.timeout(60)
def test_each_chunk_taken_plays_env_by_env():
    """In a chunk from the queue, one env plays on while the answer of
    another env of the same chunk (and group) is held back."""
    specs = specs_for(["FrozenLake"], [2], 2, custom_envs(), seed=3)  # groups: envs 0, 1 and envs 2, 3
    config = loop_config(max_turn=4)
    reference, _ = run_envs(specs, DirectClient(ScriptedEngine()), config, kept_envs=KeptEnvs())
    env3_turns = len(reference[3].turns)
    assert env3_turns >= 2 and [s.group_id for s in specs[2:]] == [1, 1]
    chunks = [specs[2:]]
    engine = GatedEngine(held=2, until=(3, env3_turns - 1))
    try:
        got, stats = run_envs(specs[:2], StreamingDirectClient(engine), config, kept_envs=KeptEnvs(),
                              batching=EnvLevel(), take=lambda: chunks.pop(0) if chunks else [])
    finally:
        engine.close()
    assert got == reference and stats.chunks == 1
    # env 3 asked for every one of its turns while env 2's first answer was still held
    assert [k for k in engine.asked_before(2, 1) if k[0] == 3] == [(3, t) for t in range(env3_turns)]


class _Probe:
    """Steps of the probe envs in progress at once: the most seen."""

    lock = threading.Lock()
    now = 0
    most = 0


class ProbeEnv:
    """A language env whose step waits a little (an I/O wait, such as a search's) and
    counts how many probe envs are stepping at that moment."""

    def __init__(self, config=None):
        self.config = config

    def reset(self, seed=None, **kwargs):
        return f"Say anything. seed {seed}"

    def step(self, action):
        import time

        with _Probe.lock:
            _Probe.now += 1
            _Probe.most = max(_Probe.most, _Probe.now)
        time.sleep(0.02)
        with _Probe.lock:
            _Probe.now -= 1
        return "ok", 0.0, False, {}

    def close(self):
        pass


@pytest.mark.timeout(120)
def test_env_level_steps_a_parallel_friendly_tags_envs_on_threads_together():
    """Env-level turns make each env a stream of its own; the answers an engine call
    returns together still step on the tag's threads at once, not one after another."""
    tag = {"env_type": "tests.test_env_level:ProbeEnv", "max_actions_per_traj": 4, "env_instruction": "Talk.",
           "parallel_friendly": True, "max_workers": 8}
    specs = specs_for(["Probe"], [16], 1, custom_envs(Probe=tag))
    lockstep, _ = run_envs(specs, DirectClient(ScriptedEngine(malformed_rate=0.1)), loop_config(max_turn=3),
                           kept_envs=KeptEnvs())
    engine = streaming_engine(tokens_sigma=0.0, tokens_median=5)  # answers of one length: they end together
    import importlib

    probe = importlib.import_module("tests.test_env_level")._Probe  # the module the env type names
    probe.most = 0
    try:
        got, _ = run_envs(specs, direct_client(engine), loop_config(max_turn=3), kept_envs=KeptEnvs(),
                          batching=EnvLevel())
    finally:
        engine.close()
    assert got == lockstep
    assert probe.most >= 4
