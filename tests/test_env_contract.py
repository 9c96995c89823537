"""The contract every built-in env keeps, checked for each of them.

Determinism per seed, different seeds giving different episodes, instances in
two threads behaving as they do alone, pickling, reuse across many resets,
invalid actions, and the keys of ``info``.
"""

from __future__ import annotations

import pickle
import random
import sys
import threading

import pytest

from ragen.env import make_env
from ragen.env.countdown import generate_puzzle
from ragen.env.frozen_lake import generate_map
from ragen.env.sokoban import generate_ragen_room, generate_room

ENV_SPECS = {
    "sokoban": {"dim_x": 6, "dim_y": 6, "num_boxes": 1, "max_steps": 30},
    "sokoban_8x8": {"dim_x": 8, "dim_y": 8, "num_boxes": 2, "search_depth": 300},
    "frozen_lake": {"size": 5, "is_slippery": True},
    "bandit": {"split": "train"},
    "countdown": {"num_count": 4},
}
INVALID_ACTIONS = [None, "Up", "garbage", 0, 99, -1, 2.5, True, [1], {"a": 1}, b"1"]


def build(name: str):
    return make_env(name.split("_8x8")[0], ENV_SPECS[name])


def pick_action(env, rng: random.Random):
    """A deterministic mix of valid and invalid actions for any env."""
    if rng.random() < 0.15:
        return rng.choice(INVALID_ACTIONS)
    if hasattr(env, "puzzle"):  # countdown: right answer, wrong answer or garbage
        return rng.choice([env.puzzle.solution, "1 + 2", "(3 * 4) - 5", "1 +", "x"])
    return rng.choice(env.get_all_actions())


def play(env, seed: int, policy_seed: int, max_steps: int = 25) -> list:
    """Observations, rewards, dones and infos of one episode."""
    rng = random.Random(policy_seed)
    trace = [env.reset(seed=seed)]
    for _ in range(max_steps):
        obs, reward, done, info = env.step(pick_action(env, rng))
        trace.append((obs, reward, done, info))
        if done:
            break
    return trace


def clear_memos() -> None:
    generate_room.cache_clear()
    generate_ragen_room.cache_clear()
    generate_map.cache_clear()
    generate_puzzle.cache_clear()


@pytest.mark.parametrize("name", list(ENV_SPECS))
def test_same_seed_same_episode(name):
    a, b = build(name), build(name)
    for seed in range(5):
        first = play(a, seed, policy_seed=seed)
        clear_memos()  # the second run must regenerate, not just hit the memo
        assert play(b, seed, policy_seed=seed) == first
        assert play(a, seed, policy_seed=seed) == first  # and again on a reused instance


@pytest.mark.parametrize("name", list(ENV_SPECS))
def test_different_seeds_differ(name):
    env = build(name)
    observations = {env.reset(seed=seed) for seed in range(20)}
    # bandit has only two observations (arm order); the others vary much more
    assert len(observations) >= (2 if name == "bandit" else 10)


@pytest.mark.parametrize("name", list(ENV_SPECS))
def test_two_threads_match_running_alone(name):
    # overlapping seeds: both threads also hit the shared room memo at once
    seeds = {0: list(range(100, 130)), 1: list(range(115, 145))}

    def run(thread_id: int, out: dict, barrier: threading.Barrier | None = None) -> None:
        env = build(name)
        if barrier is not None:
            barrier.wait()
        out[thread_id] = [play(env, s, policy_seed=s + thread_id) for s in seeds[thread_id]]

    alone: dict = {}
    for thread_id in seeds:
        clear_memos()
        run(thread_id, alone)

    clear_memos()
    together: dict = {}
    barrier = threading.Barrier(2)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: interleave real work
    try:
        threads = [threading.Thread(target=run, args=(i, together, barrier)) for i in seeds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert together == alone


@pytest.mark.parametrize("name", list(ENV_SPECS))
def test_pickle_round_trip_mid_episode(name):
    env = build(name)
    rng = random.Random(3)
    env.reset(seed=11)
    env.step(pick_action(env, rng))
    clone = pickle.loads(pickle.dumps(env))
    assert clone.render() == env.render()
    continuation = random.Random(5)
    actions = [pick_action(env, continuation) for _ in range(10)]
    assert [clone.step(a) for a in actions] == [env.step(a) for a in actions]
    # a fresh, never-reset instance pickles too (workers receive them that way)
    assert type(pickle.loads(pickle.dumps(build(name)))) is type(env)


@pytest.mark.parametrize("name", list(ENV_SPECS))
def test_invalid_actions_do_not_crash_or_end_the_episode(name):
    env = build(name)
    first = env.reset(seed=7)
    # countdown's action is the answer text, any text (RAGEN judges it): only other values are invalid
    for action in [a for a in INVALID_ACTIONS if not (name == "countdown" and isinstance(a, str))]:
        obs, reward, done, info = env.step(action)
        assert info["action_is_valid"] is False
        assert info["action_is_effective"] is False
        assert done is False
        assert obs == first
        assert reward == 0.0
    # the episode is untouched: a valid episode still plays out as on a fresh env
    fresh = build(name)
    assert play(env, 7, policy_seed=1) == play(fresh, 7, policy_seed=1)


@pytest.mark.parametrize("name", list(ENV_SPECS))
def test_info_keys_and_types(name):
    env = build(name)
    for seed in range(10):
        for obs, reward, done, info in play(env, seed, policy_seed=seed)[1:]:
            assert isinstance(obs, str)
            assert type(reward) in (int, float)  # RAGEN's types: a prompt shows str() of a turn's sum
            assert isinstance(done, bool)
            assert {"action_is_valid", "action_is_effective", "success"} <= set(info)
            assert all(isinstance(info[k], bool) for k in ("action_is_valid", "action_is_effective", "success"))


@pytest.mark.parametrize("name", list(ENV_SPECS))
def test_many_resets_on_one_instance(name):
    env = build(name)
    fresh_obs = [build(name).reset(seed=s) for s in range(5)]
    for _ in range(3):
        for seed in range(5):
            play(env, seed, policy_seed=seed)
    assert [env.reset(seed=s) for s in range(5)] == fresh_obs


@pytest.mark.parametrize("name", list(ENV_SPECS))
def test_step_before_reset_is_a_clear_error(name):
    with pytest.raises(RuntimeError, match="reset"):
        build(name).step(1)


@pytest.mark.parametrize("name", list(ENV_SPECS))
def test_reset_without_seed_records_a_replayable_seed(name):
    env = build(name)
    obs = env.reset()
    assert isinstance(env.seed, int)
    assert build(name).reset(seed=env.seed) == obs


@pytest.mark.parametrize("name", list(ENV_SPECS))
def test_negative_seeds_work(name):
    env = build(name)
    assert env.reset(seed=-3) == build(name).reset(seed=-3)
