"""Bandit: RAGEN's two-armed bandit with symbolic arm names drawn per episode."""

from __future__ import annotations

import pytest

from ragen.env import make_env, make_env_config
from ragen.env.bandit import BanditEnv, BanditEnvConfig
from ragen.env.bandit.config import ARM_NAMES


def test_ids_follow_the_drawn_order_and_the_text_names_them_in_id_order():
    env = BanditEnv()
    lo_first = set()
    for seed in range(40):
        obs = env.reset(seed=seed)
        assert (env.lo_arm_name, env.hi_arm_name) in ARM_NAMES["train"]
        assert set(env.ACTION_LOOKUP.values()) == {env.lo_arm_name, env.hi_arm_name}
        assert obs.index(f"named {env.ACTION_LOOKUP[1]} and {env.ACTION_LOOKUP[2]}\n") > 0
        lo_first.add(env.ACTION_LOOKUP[1] == env.lo_arm_name)
    assert lo_first == {True, False}


def test_rewards_and_success():
    env = BanditEnv()
    hi = []
    for seed in range(2000):
        env.reset(seed=seed)
        lo_id = next(k for k, v in env.ACTION_LOOKUP.items() if v == env.lo_arm_name)
        obs, reward, done, info = env.step(lo_id)
        assert (reward, done, info["success"]) == (0.1, True, False)
        assert obs == f"{env.lo_arm_name}: 0.1 points"
        env.reset(seed=seed)
        obs, reward, done, info = env.step(3 - lo_id)
        assert done and info["success"] and reward in (0.0, 1.0)
        hi.append(reward)
    assert 0.21 < sum(hi) / len(hi) < 0.29


def test_custom_scores_and_start():
    env = BanditEnv(BanditEnvConfig(action_space_start=3, lo_arm_score=0.5, hi_arm_hiscore_prob=1.0, hi_arm_hiscore=2))
    assert env.get_all_actions() == [3, 4]
    for action in (3, 4):
        env.reset(seed=0)
        obs, reward, _, _ = env.step(action)
        lo = env.ACTION_LOOKUP[action] == env.lo_arm_name
        assert reward == (0.5 if lo else 2) and type(reward) is (float if lo else int)  # as configured, as RAGEN
        assert obs.endswith(": 0.5 points" if lo else ": 2 points")  # an int score is written as given
    assert env.step(1)[3]["action_is_valid"] is False


def test_arm_name_as_text_is_not_an_action():
    env = BanditEnv()
    env.reset(seed=0)
    obs, reward, done, info = env.step(env.hi_arm_name)
    assert (reward, done, info["action_is_valid"]) == (0.0, False, False)
    assert env.step(2)[2] is True  # the episode went on


def test_a_second_pull_earns_nothing():
    env = BanditEnv()
    env.reset(seed=0)
    env.step(1)
    obs, reward, done, info = env.step(2)
    assert (reward, done, info["action_is_effective"]) == (0.0, True, False)


def test_train_and_test_splits():
    train = make_env("bandit", {"split": "train"}, tag="Bandit")
    test = make_env("bandit", {"split": "test"}, tag="BanditTest")
    for seed in range(20):
        train.reset(seed=seed)
        test.reset(seed=seed)
        assert (train.lo_arm_name, train.hi_arm_name) in ARM_NAMES["train"]
        assert (test.lo_arm_name, test.hi_arm_name) in ARM_NAMES["test"]
    again = make_env("bandit", {"split": "test"})
    assert again.reset(seed=7) == test.reset(seed=7)


@pytest.mark.parametrize(
    "values,field",
    [
        ({"lo_arm_name": "phoenix"}, "lo_arm_name"),
        ({"hi_arm_hiscore_prob": 1.5}, "hi_arm_hiscore_prob"),
        ({"lo_arm_score": "0.1"}, "lo_arm_score"),
        ({"action_space_start": 1.0}, "action_space_start"),
        ({"render_mode": "rgb_array"}, "render_mode"),
        ({"action_lookup": ["a", "b"]}, "action_lookup"),
    ],
)
def test_config_errors_name_the_field(values, field):
    with pytest.raises(ValueError, match=rf"^custom_envs\.Bandit\.env_config\.{field}"):
        make_env_config("bandit", values, tag="Bandit")


@pytest.mark.parametrize("start,message", [
    (2**40, "must be <= 2147483647, got 1099511627776"),
    (-2**31 - 1, "must be >= -2147483648, got -2147483649"),
])
def test_the_first_action_id_is_bounded_naming_the_bound(start, message):
    with pytest.raises(ValueError, match=rf"^custom_envs\.Bandit\.env_config\.action_space_start: {message}$"):
        make_env_config("bandit", {"action_space_start": start}, tag="Bandit")


def test_unknown_split_is_named():
    with pytest.raises(ValueError, match=r"env_config.split: must be one of \['train', 'test'\]"):
        make_env("bandit", {"split": "validation"}, tag="Bandit")
