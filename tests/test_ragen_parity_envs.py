"""Our FrozenLake, Bandit and Countdown give RAGEN's episodes: every fixture of tests/fixtures/ragen, all seeds.

The fixtures come from RAGEN's own env modules (``make_fixtures.py`` beside
them says how); here each episode is replayed on our env with the same config,
seed and actions, and every observation, reward, done and info must be equal.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ragen.env import make_env

FIXTURES = Path(__file__).parent / "fixtures" / "ragen"


def load(name: str) -> dict:
    with gzip.open(FIXTURES / name, "rt", encoding="utf-8") as f:
        return json.load(f)


def cases(name: str) -> list:
    data = load(name)
    return [pytest.param(config, id=config_name) for config_name, config in data["configs"].items()]


def replay(env, episode: dict) -> None:
    seed = episode["seed"]
    assert env.reset(seed=seed) == episode["reset"], f"seed {seed}: reset observation"
    for i, step in enumerate(episode["steps"]):
        obs, reward, done, info = env.step(step["action"])
        where = f"seed {seed}, step {i}, action {step['action']}"
        assert obs == step["obs"], where
        assert reward == step["reward"], where
        assert done is step["done"], where
        assert {k: info[k] for k in step["info"]} == step["info"], where


def test_fixtures_record_their_command_and_ragen_commit():
    for name in ("frozen_lake.json.gz", "bandit.json.gz", "countdown.json.gz"):
        data = load(name)
        assert data["command"].startswith("python tests/fixtures/ragen/make_fixtures.py --ragen-src ")
        assert "RAGEN" in data["ragen_commit"] and len(data["ragen_commit"].split()[-1]) == 40
        assert all(len(c["episodes"]) == data["seeds"] == 200 for c in data["configs"].values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", cases("frozen_lake.json.gz"))
def test_frozen_lake_matches_ragen(config):
    env = make_env("frozen_lake", config["env_config"], tag="FrozenLake")
    for episode in config["episodes"]:
        replay(env, episode)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", cases("bandit.json.gz"))
def test_bandit_matches_ragens_first_instance(config):
    assert config["instance"] == 0
    env = make_env("bandit", config["env_config"], tag="Bandit")
    for episode in config["episodes"]:
        replay(env, episode)


@pytest.mark.timeout(120)
def test_countdown_judges_answers_as_ragen_does():
    from ragen.env.countdown import CountdownPuzzle

    data = load("countdown.json.gz")
    env = make_env("countdown", data["configs"]["default"]["env_config"], tag="Countdown")
    for episode in data["configs"]["default"]["episodes"]:
        puzzle = CountdownPuzzle(tuple(episode["nums"]), episode["target"], "")
        for step in episode["steps"]:
            assert env.load_puzzle(puzzle) == episode["reset"]
            obs, reward, done, info = env.step(step["action"])
            where = f"seed {episode['seed']}, answer {step['action']!r}"
            assert (obs, reward, done, info) == (step["obs"], step["reward"], step["done"], step["info"]), where
