"""reasoning-gym's datasets as an env (``env_type: reasoning_gym``)."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym", reason="needs reasoning-gym (pip install -e '.[envs]')")

from ragen.env import make_env, make_env_config  # noqa: E402
from ragen.env.check.checker import check_env  # noqa: E402
from ragen.llm.scripted import ScriptedEngine  # noqa: E402
from ragen.rollout.types import rollout_digest  # noqa: E402
from tests.rollout_helpers import custom_envs, loop_config, sequential, specs_for  # noqa: E402

RG_TAGS = ["RGChainSum", "RGLetterCounting", "RGKnightsKnaves", "RGWordSorting"]


def test_the_seed_picks_the_question_in_any_instance():
    a, b = make_env("reasoning_gym", {"dataset": "letter_counting"}), make_env("reasoning_gym",
                                                                                {"dataset": "letter_counting"})
    assert a.reset(seed=11) == b.reset(seed=11)
    assert a.item["answer"] == b.item["answer"]
    assert len({a.reset(seed=s) for s in range(8)}) == 8


def test_the_datasets_own_scorer_gives_the_reward():
    env = make_env("reasoning_gym", {"dataset": "chain_sum", "min_terms": 2, "max_terms": 3})
    env.reset(seed=3)
    obs, reward, done, info = env.step(env.item["answer"])
    assert (reward, done, info["success"]) == (1.0, True, True)
    assert reward == env.dataset.score_answer(env.item["answer"], env.item)
    env.reset(seed=3)
    obs, reward, done, info = env.step("not a number")
    assert (reward, done, info["success"]) == (0.0, True, False)
    assert obs == "Your answer scored 0."
    # answered: a second action changes nothing
    assert env.step(env.item["answer"])[1:3] == (0.0, True)


def test_attempts_show_the_score_and_the_question_again():
    env = make_env("reasoning_gym", {"dataset": "chain_sum", "attempts": 3})
    question = env.reset(seed=4)
    obs, reward, done, _ = env.step("0")
    assert (reward, done) == (0.0, False) and obs == f"Your answer scored 0. 2 attempts left.\n{question}"
    obs, reward, done, _ = env.step("1")
    assert obs.startswith("Your answer scored 0. 1 attempt left.")
    obs, reward, done, info = env.step(env.item["answer"])
    assert (reward, done, info["success"]) == (1.0, True, True)
    env.reset(seed=4)
    for _ in range(3):
        obs, reward, done, info = env.step("0")
    assert done and not info["success"] and reward == 0.0


@pytest.mark.parametrize("env_config,match", [
    ({"dataset": "chain_sun"}, r"env_config.dataset: unknown reasoning-gym dataset 'chain_sun'; close matches: "
                               r"\['chain_sum'"),
    ({"dataset": "chain_sum", "bogus": 1}, r"env_config.bogus: not an option of reasoning-gym's ChainSumConfig"),
    ({"dataset": "chain_sum", "min_terms": 0}, r"env_config.min_terms: ChainSumConfig refuses"),
    ({"dataset": "chain_sum", "seed": 3}, r"env_config.seed: set by the env"),
    ({"dataset": "chain_sum", "attempts": 0}, r"env_config.attempts"),
])
def test_bad_configs_name_the_key(env_config, match):
    with pytest.raises(ValueError, match=match):
        make_env_config("reasoning_gym", env_config, tag="RG")


@pytest.mark.parametrize("tag", RG_TAGS)
def test_the_shipped_tags_pass_the_env_checker(tag):
    entry = custom_envs()[tag]
    report = check_env(entry["env_type"], entry["env_config"], seeds=4)
    assert report.ok and not report.warnings(), report.format()


def test_a_group_shares_its_question_and_parallel_equals_sequential():
    from ragen.llm_agent import ParallelRolloutManager, SharedLLMInferenceManager

    specs = specs_for(RG_TAGS, [1, 1, 1, 1], 2, custom_envs())
    config = loop_config(max_turn=3)
    ref = sequential(specs, config, ScriptedEngine(malformed_rate=0.1))
    for first, second in zip(ref[::2], ref[1::2]):
        assert first.turns[0].observation == second.turns[0].observation
    with SharedLLMInferenceManager(ScriptedEngine(malformed_rate=0.1)) as shared, \
            ParallelRolloutManager(shared, n_jobs=2) as prm:
        result = prm.rollout(specs, config)
    assert rollout_digest(result.trajectories) == rollout_digest(ref)
    assert result.metrics["parallel/fallbacks"] == 0
    assert all(t.error is None for t in result.trajectories)


def test_the_checker_takes_a_dataset_by_name(capsys):
    from ragen.tools.check import main

    assert main(["reasoning_gym:chain_sum", "--seeds", "2"]) == 0
    assert "OK: 0 failed" in capsys.readouterr().out
    assert main(["reasoning_gym:chain_sun", "--seeds", "2"]) == 1
    assert "close matches: ['chain_sum'" in capsys.readouterr().out


@pytest.mark.parametrize("dataset", ["arc_1d", "pool_matrix", "prime_factorization", "tsumego"])
def test_datasets_that_pickle_badly_use_the_global_generators_or_raise_in_scoring_pass_the_checker(dataset):
    """arc_1d holds lambdas (not pickled: built again from the seed), pool_matrix draws from
    np.random (seeded privately), prime_factorization's scorer raises on text (score 0), tsumego's
    config has no validate."""
    report = check_env("reasoning_gym", {"dataset": dataset}, seeds=3)
    assert report.ok and not report.warnings(), report.format()
