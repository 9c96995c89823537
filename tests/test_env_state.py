"""RAGEN's ``EnvStateManager`` interface (``ragen.llm_agent.es_manager``): built
from the whole config and a mode, ``reset`` with RAGEN's seeds, ``step`` by
action names, ``get_rollout_states`` with RAGEN's metrics."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ragen.llm_agent.es_manager import EnvStateManager, EnvStatus
from ragen.rollout.envs import EnvSpecMaker

from tests.rollout_helpers import custom_envs


def config(train_groups=(2, 1), group_size=2, seed_train=10, seed_val=123):
    return {
        "custom_envs": custom_envs(),
        "seed": {"train": seed_train, "val": seed_val},
        "es_manager": {
            "format_penalty": -0.1,
            "train": {"env_groups": sum(train_groups), "group_size": group_size,
                      "env_configs": {"tags": ["SimpleSokoban", "FrozenLake"], "n_groups": list(train_groups)}},
            "val": {"env_groups": 2, "group_size": 1, "env_configs": {"tags": ["Bandit"], "n_groups": [2]}},
        },
    }


def two_frozen_lakes() -> dict:
    """The config of one FrozenLake group of two envs to train on."""
    cfg = config()
    cfg["es_manager"]["train"] = {"env_groups": 1, "group_size": 2,
                                  "env_configs": {"tags": ["FrozenLake"], "n_groups": [1]}}
    return cfg


def test_envs_are_built_per_group_and_seeds_iterate_as_ragens():
    es = EnvStateManager(config(), mode="train")
    try:
        assert [(e["tag"], e["group_id"], e["env_id"]) for e in es.envs] == [
            ("SimpleSokoban", 0, 0), ("SimpleSokoban", 0, 1), ("SimpleSokoban", 1, 2), ("SimpleSokoban", 1, 3),
            ("FrozenLake", 2, 4), ("FrozenLake", 2, 5)]
        es.reset()
        assert [e["status"].seed for e in es.envs] == [10, 10, 11, 11, 12, 12]
        es.reset()  # training seeds advance env_groups a reset
        assert [e["status"].seed for e in es.envs] == [13, 13, 14, 14, 15, 15]
        es.reset(seed=100)  # an explicit seed, and RAGEN's counter after it
        assert [e["status"].seed for e in es.envs][::2] == [100, 101, 102] and es.seed_counter == 91
        assert all(isinstance(e["status"], EnvStatus) and e["status"].num_actions == 0 for e in es.envs)
    finally:
        es.close()
    val = EnvStateManager(config(), mode="val")
    try:
        for _ in range(2):  # one fixed validation set
            val.reset()
            assert [e["status"].seed for e in val.envs] == [123, 124]
    finally:
        val.close()
    with pytest.raises(ValueError, match="mode must be 'train' or 'val'"):
        EnvStateManager(config(), mode="test")


def test_the_same_seed_gives_the_rollouts_initial_state():
    cfg = config()
    es = EnvStateManager(cfg, mode="train")
    try:
        cache = es.reset()
        specs = EnvSpecMaker("train", cfg["es_manager"]["train"], cfg["custom_envs"], 10).make_specs()
        from ragen.env import make_env

        for spec, c in zip(specs, cache):
            env = make_env(spec.env_type, spec.env_config, tag=spec.tag)
            assert c["history"][0]["state"] == env.reset(seed=spec.seed)
            assert c["history"][0]["actions_left"] == spec.max_actions_per_traj
    finally:
        es.close()


def test_step_maps_action_names_charges_the_format_penalty_and_drops_done_envs():
    es = EnvStateManager(two_frozen_lakes(), mode="train")
    try:
        es.reset()
        out = es.step([{"env_id": 0, "actions": ["LEFT", "jump"], "llm_response": "r", "llm_raw_response": "raw"},
                       {"env_id": 1, "actions": [], "llm_response": "", "llm_raw_response": ""}])
        first, second = es.rollout_cache
        assert first["penalty"] == pytest.approx(-0.1) and second["penalty"] == pytest.approx(-0.1)
        assert first["history"][0]["actions"] == [1] and first["history"][0]["llm_raw_response"] == "raw"
        assert first["history"][1]["actions_left"] == es.envs[0]["max_actions_per_traj"] - 1
        assert es.envs[0]["status"].num_actions == 1 and es.envs[1]["status"].num_actions == 0
        assert type(second["history"][0]["reward"]) is int  # nothing stepped: RAGEN's int 0
        assert [c["env_id"] for c in out] == [e["env_id"] for e in es.envs if not e["status"].terminated]
        # an env that spends its action budget is done, and is not sent on
        budget = es.envs[1]["max_actions_per_traj"]
        out = es.step([{"env_id": 1, "actions": ["Left"] * (budget + 3), "llm_response": "", "llm_raw_response": ""}])
        status = es.envs[1]["status"]
        assert status.terminated and status.num_actions <= budget and all(c["env_id"] != 1 for c in out)
        states = es.get_rollout_states()
        assert {"FrozenLake/success", "FrozenLake/num_actions", "FrozenLake/pass@2"} <= set(states[0]["metrics"])
        assert len(es.render()) == 2
    finally:
        es.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env_id, message", [
    (-1, "env_id -1 is not an env of this EnvStateManager: its env ids are 0 to 5"),
    (99, "env_id 99 is not an env of this EnvStateManager: its env ids are 0 to 5"),
    ("0", "env_id '0' is not an env of this EnvStateManager: its env ids are 0 to 5"),
    (True, "env_id True is not an env of this EnvStateManager: its env ids are 0 to 5"),
])
def test_step_names_an_env_id_out_of_range(env_id, message):
    es = EnvStateManager(config(), mode="train")
    try:
        es.reset()
        good = {"env_id": 0, "actions": ["Up"], "llm_response": "", "llm_raw_response": ""}
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            es.step([good, {**good, "env_id": env_id}])
        # nothing stepped: not the last env (what -1 would index), nor the good one before it
        assert all(e["status"].num_actions == 0 for e in es.envs)
        assert all(len(c["history"]) == 1 for c in es.rollout_cache)
        es.step([{**good, "env_id": np.int64(5)}])  # RAGEN's proxy takes the ids from a numpy array
        assert es.envs[5]["status"].num_actions == 1
    finally:
        es.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["train", "val"])
def test_a_mode_needs_only_its_own_split(mode):
    other = "val" if mode == "train" else "train"
    cfg = config()
    del cfg["es_manager"][other]
    es = EnvStateManager(cfg, mode=mode)  # RAGEN's reads es_manager[mode] only
    try:
        assert len(es.reset()) == len(es.envs) == (6 if mode == "train" else 2)
    finally:
        es.close()
    with pytest.raises(ValueError, match=f"es_manager.{other} is missing"):
        EnvStateManager(cfg, mode=other)
    cfg["es_manager"]["trian"] = {}
    with pytest.raises(ValueError, match="es_manager.trian is not a known key"):  # still strict
        EnvStateManager(cfg, mode=mode)


@pytest.mark.timeout(60)
def test_an_env_that_ended_is_not_stepped_again_before_a_reset():
    es = EnvStateManager(two_frozen_lakes(), mode="train")
    try:
        es.reset()
        budget = es.envs[0]["max_actions_per_traj"]
        out = es.step([{"env_id": 0, "actions": ["Left"] * budget, "llm_response": "", "llm_raw_response": ""}])
        assert es.envs[0]["status"].terminated and out == []
        actions = es.envs[0]["status"].num_actions
        with pytest.raises(ValueError, match="^env_id 0 has ended since the last reset"):
            es.step([{"env_id": 1, "actions": ["Up"], "llm_response": "", "llm_raw_response": ""},
                     {"env_id": 0, "actions": ["Up"], "llm_response": "", "llm_raw_response": ""}])
        assert es.envs[0]["status"].num_actions == actions and es.envs[1]["status"].num_actions == 0  # none stepped
        es.reset()
        es.step([{"env_id": 0, "actions": ["Up"], "llm_response": "", "llm_raw_response": ""}])
        assert es.envs[0]["status"].num_actions == 1
    finally:
        es.close()
