"""The scheduler's batching policies: the streams each forms, which chunks ride along,
which engine errors end envs alone, and the one ``choose_batching`` picks."""

from __future__ import annotations

from operator import attrgetter

import pytest

from ragen.llm.types import EngineError
from ragen.rollout.batching import EnvLevel, Lockstep, choose_batching, split_streams, stream_count

from tests.rollout_helpers import custom_envs, loop_config, specs_for

GROUP = attrgetter("group_id")


def test_lockstep_deals_whole_groups_over_its_depth():
    specs = specs_for(["Bandit"], [5], 2, custom_envs())
    streams = split_streams(specs, 2, group_id=GROUP)
    assert [[s.group_id for s in stream] for stream in streams] == [[0, 0, 2, 2, 4, 4], [1, 1, 3, 3]]
    assert stream_count(specs, 2) == 2 and stream_count(specs, 9) == 5 and stream_count(specs[:2], 3) == 1
    assert split_streams(specs[:2], 4, group_id=GROUP) == [specs[:2]]  # never an empty stream


def test_a_chunk_past_the_lockstep_depth_rides_along():
    chunk = ["a", "b", "c"]
    assert Lockstep(depth=2).chunk_streams(chunk, open_streams=1) == [(chunk, False)]
    assert Lockstep(depth=2).chunk_streams(chunk, open_streams=2) == [(chunk, True)]
    assert Lockstep().streams([]) == []


def test_env_level_gives_every_env_a_stream_and_bounds_its_wait():
    assert EnvLevel().streams(["a", "b"]) == [["a"], ["b"]]
    assert EnvLevel().chunk_streams(["a", "b"], open_streams=5) == [(["a"], False), (["b"], False)]
    assert EnvLevel.hold and EnvLevel.bounded_wait and not Lockstep.hold and not Lockstep.bounded_wait


@pytest.mark.parametrize("timed_out, lockstep, env_level", [(True, True, True), (False, False, True)])
def test_an_engine_error_ends_envs_alone_where_the_policy_says(timed_out, lockstep, env_level):
    exc = EngineError("boom", 3, timed_out=timed_out)
    assert Lockstep().ends_alone(exc) is lockstep
    assert EnvLevel().ends_alone(exc) is env_level


@pytest.mark.parametrize("mode, streams, want", [
    ("auto", True, EnvLevel), ("auto", False, Lockstep), (True, False, EnvLevel), (False, True, Lockstep)])
def test_choose_batching_follows_env_level_async_and_the_client(mode, streams, want):
    chosen = choose_batching(loop_config(env_level_async=mode), streams, depth=3, max_live_envs=7)
    assert type(chosen) is want and chosen.max_live_envs == 7
    if want is Lockstep:
        assert chosen.depth == 3
