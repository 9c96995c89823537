"""The turn loop with no barrier between envs (``run_envs(..., env_level=True)``)
on an engine that batches continuously: each env takes its next turn as soon
as its own answer is in, and the trajectories are the lockstep loop's."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import StreamingEngine
from ragen.rollout.loop import KeptEnvs, run_envs
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
            got, stats = run_envs(specs, direct_client(engine), config, kept_envs=KeptEnvs(), env_level=env_level,
                                  pipeline_depth=depth)
            assert got == reference, (env_level, depth)
            assert [[t.logprobs for t in tr.turns] for tr in got] == [[t.logprobs for t in tr.turns] for tr in reference]
            if env_level:  # one request an env and turn
                assert stats.requests == stats.submits == sum(len(t.turns) for t in got) + sum(
                    1 for t in got if t.failed_response is not None)
    finally:
        engine.close()


class GatedEngine(StreamingEngine):
    """The scripted policy, answering at once, except env 0's requests: held
    until env 1 has asked for its last turn."""

    def __init__(self, env1_last_turn: int) -> None:
        super().__init__()
        self.inner = ScriptedEngine()
        self.env1_last_turn = env1_last_turn
        self.held: list[tuple[Future, object, object]] = []
        self.released = False
        self.asked: list[tuple[int, int]] = []

    def submit(self, requests, sampling):
        futures = []
        for r in requests:
            self.asked.append((r.env_id, r.turn))
            f: Future = Future()
            futures.append(f)
            if r.env_id == 0 and not self.released:
                self.held.append((f, r, sampling))
            else:
                f.set_result(self.inner.generate([r], sampling)[0])
            if r.env_id == 1 and r.turn == self.env1_last_turn:
                self.released = True
        if self.released:
            for f, r, s in self.held:
                f.set_result(self.inner.generate([r], s)[0])
            self.held = []
        return futures


@pytest.mark.timeout(60)
def test_an_env_plays_on_while_another_waits_for_its_answer():
    specs = specs_for(["FrozenLake"], [2], 1, custom_envs(), seed=3)
    config = loop_config(max_turn=4)
    reference, _ = run_envs(specs, DirectClient(ScriptedEngine()), config, kept_envs=KeptEnvs())
    env1_turns = len(reference[1].turns)
    assert env1_turns >= 2
    engine = GatedEngine(env1_last_turn=env1_turns - 1)
    got, _ = run_envs(specs, StreamingDirectClient(engine), config, kept_envs=KeptEnvs(), env_level=True)
    assert got == reference
    # env 1 asked for every one of its turns while env 0's first answer was still held
    first_of_env0_after = engine.asked.index((0, 1)) if (0, 1) in engine.asked else len(engine.asked)
    assert [k for k in engine.asked[:first_of_env0_after] if k[0] == 1] == [(1, t) for t in range(env1_turns)]


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
        answered = {client.wait_any()[0] for _ in tickets}
        assert answered == set(tickets) and not client.ready()
        with pytest.raises(RuntimeError, match="no request in flight"):  # never an endless wait on nothing
            client.wait_any()
        assert client.engine_calls == 3 and client.batch_sizes == [1, 1, 1] and client.engine_time_s > 0
    finally:
        engine.close()
    with pytest.raises(TypeError, match="does not stream"):
        StreamingDirectClient(ScriptedEngine())


@pytest.mark.timeout(120)
def test_env_level_takes_chunks_from_a_queue():
    """Pull-based work: each chunk taken plays env by env, with the lockstep loop's trajectories."""
    specs = specs_for(["SimpleSokoban", "FrozenLake", "Bandit"], [3, 3, 2], 2, custom_envs(), seed=3)
    config = loop_config(max_turn=3)
    reference, _ = run_envs(specs, DirectClient(ScriptedEngine(malformed_rate=0.1)), config, kept_envs=KeptEnvs())
    chunks = [specs[i: i + 4] for i in range(4, len(specs), 4)]
    engine = streaming_engine()
    try:
        got, stats = run_envs(specs[:4], StreamingDirectClient(engine), config, kept_envs=KeptEnvs(), env_level=True,
                              take=lambda: chunks.pop(0) if chunks else [], max_live_envs=6)
    finally:
        engine.close()
    assert got == reference and stats.chunks == 3
