"""Bandit: RAGEN's two-armed bandit with symbolic arm names."""

from __future__ import annotations

import pytest

from ragen.env import make_env, make_env_config
from ragen.env.bandit import BanditEnv, BanditEnvConfig


def test_action_lookup_is_fixed_per_instance_while_the_text_order_varies():
    env = BanditEnv(BanditEnvConfig(lo_arm_name="phoenix", hi_arm_name="dragon"))
    orders = set()
    for seed in range(40):
        obs = env.reset(seed=seed)
        assert env.ACTION_LOOKUP == {1: "phoenix", 2: "dragon"}
        orders.add(obs.index("phoenix") < obs.index("dragon"))
    assert orders == {True, False}


def test_rewards_and_success():
    env = BanditEnv()
    lo, hi = [], []
    for seed in range(2000):
        env.reset(seed=seed)
        obs, reward, done, info = env.step(1)
        assert (reward, done, info["success"]) == (0.1, True, False)
        assert obs == "phoenix: 0.1 points"
        env.reset(seed=seed)
        obs, reward, done, info = env.step(2)
        assert done and info["success"] and reward in (0.0, 1.0)
        hi.append(reward)
    assert 0.21 < sum(hi) / len(hi) < 0.29


def test_custom_scores_and_start():
    env = BanditEnv(BanditEnvConfig(action_space_start=3, lo_arm_score=0.5, hi_arm_hiscore_prob=1.0, hi_arm_hiscore=2.0))
    env.reset(seed=0)
    assert env.get_all_actions() == [3, 4]
    assert env.step(4)[1] == 2.0
    env.reset(seed=0)
    assert env.step(3)[1] == 0.5
    assert env.step(1)[3]["action_is_valid"] is False


def test_arm_name_as_text_is_not_an_action():
    env = BanditEnv()
    env.reset(seed=0)
    obs, reward, done, info = env.step("dragon")
    assert (reward, done, info["action_is_valid"]) == (0.0, False, False)
    assert env.step(2)[2] is True  # the episode went on


def test_a_second_pull_earns_nothing():
    env = BanditEnv()
    env.reset(seed=0)
    env.step(1)
    obs, reward, done, info = env.step(2)
    assert (reward, done, info["action_is_effective"]) == (0.0, True, False)


def test_train_and_test_tags():
    train = make_env("bandit", {"lo_arm_name": "phoenix", "hi_arm_name": "dragon"}, tag="Bandit")
    test = make_env("bandit", {"lo_arm_name": "librarian", "hi_arm_name": "trader"}, tag="BanditTest")
    assert train.ACTION_LOOKUP == {1: "phoenix", 2: "dragon"}
    assert test.ACTION_LOOKUP == {1: "librarian", 2: "trader"}
    assert "trader" in test.reset(seed=1) and "librarian" in test.reset(seed=1)


@pytest.mark.parametrize(
    "values,field",
    [
        ({"lo_arm_name": ""}, "lo_arm_name"),
        ({"hi_arm_name": "Phoenix"}, "hi_arm_name"),
        ({"hi_arm_hiscore_prob": 1.5}, "hi_arm_hiscore_prob"),
        ({"lo_arm_score": "0.1"}, "lo_arm_score"),
        ({"action_space_start": 1.0}, "action_space_start"),
    ],
)
def test_config_errors_name_the_field(values, field):
    with pytest.raises(ValueError, match=rf"^custom_envs\.Bandit\.env_config\.{field}: "):
        make_env_config("bandit", values, tag="Bandit")


def test_split_draws_arm_names_from_its_list():
    """RAGEN's ``split`` key: per-episode arm names from that split's pairs."""
    from ragen.env import make_env
    from ragen.env.bandit.config import ARM_NAME_PAIRS

    env = make_env("bandit", {"split": "test"})
    seen = set()
    for seed in range(40):
        env.reset(seed=seed)
        pair = (env.ACTION_LOOKUP[1], env.ACTION_LOOKUP[2])  # low-risk arm first
        assert pair in ARM_NAME_PAIRS["test"]
        seen.add(pair)
        obs, _, done, info = env.step(2)
        assert done and info["success"] and obs.startswith(pair[1])
    assert len(seen) > 1
    again = make_env("bandit", {"split": "test"})
    assert again.reset(seed=7) == env.reset(seed=7)


def test_unknown_split_is_named():
    import pytest

    from ragen.env import make_env

    with pytest.raises(ValueError, match=r"env_config.split: must be one of \['train', 'test'\]"):
        make_env("bandit", {"split": "validation"}, tag="Bandit")
