"""``play_episode``: one env's episode as a generator of requests, driven by hand here
as the scheduler, replay and verl's agent loop drive it: the scheduler's trajectory,
and an episode closed early ends where it stands."""

from __future__ import annotations

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.rollout.env_calls import KeptEnvs
from ragen.rollout.episode import EnvTurns
from ragen.rollout.types import StopReason

from tests.rollout_helpers import custom_envs, fault_tag, loop_config, sequential, specs_for


def drive(spec, config, engine):
    """The episode of ``spec`` played alone, each request answered by ``engine``."""
    turns = EnvTurns(config, KeptEnvs(), isolate=True)
    episode = turns.start(spec).run
    requests = []
    try:
        request = next(episode)
        while True:
            requests.append(request)
            request = episode.send(engine.generate([request], config.sampling)[0])
    except StopIteration as stop:
        return stop.value, requests
    finally:
        turns.close()


@pytest.mark.timeout(60)
def test_an_episode_driven_alone_gives_the_schedulers_trajectory():
    specs = specs_for(["SimpleSokoban", "FrozenLake", "Bandit"], [2, 2, 1], 2, custom_envs(), seed=5)
    config = loop_config(max_turn=4)
    reference = sequential(specs, config, ScriptedEngine(malformed_rate=0.1))
    engine = ScriptedEngine(malformed_rate=0.1)  # answers depend on each request alone
    for spec, want in zip(specs, reference):
        got, requests = drive(spec, config, engine)
        assert got == want
        assert [r.turn for r in requests] == list(range(len(want.turns)))
        assert all(r.env_id == spec.env_id and r.seed == spec.seed for r in requests)


@pytest.mark.timeout(60)
def test_closing_an_episode_ends_it_where_it_stands():
    spec = specs_for(["FrozenLake"], [1], 1, custom_envs(), seed=3)[0]
    turns = EnvTurns(loop_config(max_turn=5), KeptEnvs(), isolate=True)
    try:
        playing = turns.start(spec)
        playing.advance()
        assert playing.request is not None and playing.request.turn == 0
        playing.advance(ScriptedEngine().generate([playing.request], turns.config.sampling)[0])
        assert playing.request.turn == 1
        turns.end(playing, StopReason.TIMEOUT, "no answer")
        playing.close()
        assert playing.request is None
        assert playing.traj.stop_reason == StopReason.TIMEOUT and len(playing.traj.turns) == 1
        assert playing.run.gi_frame is None  # the generator has finished
    finally:
        turns.close()


@pytest.mark.timeout(60)
def test_an_env_that_fails_to_reset_ends_its_episode_before_any_request():
    envs = custom_envs(Broken=fault_tag("raise_reset", fault_seed=3))
    spec = specs_for(["Broken"], [1], 1, envs, seed=3)[0]
    trajectory, requests = drive(spec, loop_config(env_retries=0), ScriptedEngine())
    assert requests == [] and trajectory.stop_reason == StopReason.ERROR and trajectory.turns == []
