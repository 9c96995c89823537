"""An env's reset/step values are checked where the loop takes them: an
observation that is not text, a reward that is text, a NaN reward, one beyond
``es_manager.max_abs_reward`` or an episode total that is not finite ends that
env in ``error`` (named by tag and seed, a reward's error by the step too), and
the other envs, the rollout's metrics and the trainer's advantages are
untouched, on the sequential path and on a parallel backend."""

from __future__ import annotations

import logging
import math

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.rollout.types import StopReason

from tests.rollout_helpers import custom_envs

N_GROUPS, GROUP_SIZE = 4, 2


def bad_tag(bad: str = "none", bad_seed: int = -1) -> dict:
    return {"env_type": "tests.bad_output_envs:BadOutputEnv", "config_type": "tests.bad_output_envs:BadOutputEnvConfig",
            "max_actions_per_traj": 8, "env_instruction": "Bring the value to 0.",
            "env_config": {"bad": bad, "bad_seed": bad_seed}}


def config(tag: dict, parallel: bool, **es_manager) -> dict:
    return {
        "custom_envs": custom_envs(Bad=tag),
        "seed": {"train": 7, "val": 123},
        "agent_proxy": {"use_parallel_rollout": parallel, "parallel_n_jobs": 2, "max_turn": 3,
                        "max_actions_per_turn": 3, "pipeline_depth": 1, "env_retries": 1},
        "ctx_manager": {"generation": {"response_length": 64}},
        "es_manager": {
            "format_penalty": -0.1,
            "train": {"env_groups": N_GROUPS, "group_size": GROUP_SIZE,
                      "env_configs": {"tags": ["Bad"], "n_groups": [N_GROUPS]}},
            "val": {"env_groups": 1, "group_size": 1, "env_configs": {"tags": ["Bad"], "n_groups": [1]}},
            **es_manager,
        },
    }


def rollout(tag: dict, parallel: bool, **es_manager):
    with LLMAgentProxy(AgentSetup.from_config(config(tag, parallel, **es_manager)), ScriptedEngine()) as proxy:
        return proxy.rollout("train", rollout_index=0)


@pytest.fixture(scope="module")
def reference():
    """The clean rollout, and the seed of a group whose every env steps (so a bad step value is met)."""
    clean = rollout(bad_tag(), parallel=False)
    by_seed: dict[int, list] = {}
    for t in clean.trajectories:
        by_seed.setdefault(t.seed, []).append(t)
    seed = next(s for s, ts in by_seed.items() if all(t.num_actions > 0 for t in ts))
    return clean, seed


@pytest.mark.timeout(180)
@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "loky"])
@pytest.mark.parametrize("bad,error_has", [
    ("nan_reward", "step returned the reward nan, not a finite number"),
    ("str_reward", "step returned a reward of type str ('-0.1'), not a number"),
    ("huge_reward", "step returned the reward 1e+308, beyond es_manager.max_abs_reward=1e+06 (tag Bad, step 1 of "
                    "the episode, turn "),
    ("obj_observation", "step returned an observation of type list (['value', "),
    ("obj_reset", "reset returned an observation of type dict ({'text': 'value="),
])
def test_a_bad_value_from_an_env_ends_only_that_env_in_error(reference, caplog, parallel, bad, error_has):
    clean, bad_seed = reference
    with caplog.at_level(logging.WARNING, logger="ragen.llm_agent"):
        result = rollout(bad_tag(bad, bad_seed), parallel)
    assert [t.env_id for t in result.trajectories] == [t.env_id for t in clean.trajectories]  # nothing lost
    hit = [t for t in result.trajectories if t.seed == bad_seed]
    assert len(hit) == GROUP_SIZE
    for t in hit:
        assert t.stop_reason == StopReason.ERROR and error_has in t.error, (t.stop_reason, t.error)
    for got, want in zip(result.trajectories, clean.trajectories):
        if got.seed != bad_seed:  # the other envs complete as without the bad one
            assert got.stop_reason == want.stop_reason and got.turns == want.turns
    for key, value in result.metrics.items():
        if key.startswith("rollout/"):
            assert math.isfinite(value), (key, value)
    assert result.metrics["rollout/stop/error"] == GROUP_SIZE
    assert {(f["tag"], f["seed"]) for f in result.failed_envs} == {("Bad", bad_seed)}
    warned = [r.getMessage() for r in caplog.records if "ended in error" in r.getMessage()]
    assert any(f"tag Bad, seed {bad_seed}" in m and error_has in m for m in warned), warned



@pytest.mark.timeout(120)
def test_an_episode_total_that_is_not_finite_ends_the_env_in_error(reference):
    """Under a bound that lets 1e308 pass, its second step sums to inf: refused, naming the step."""
    _, bad_seed = reference
    result = rollout(bad_tag("huge_reward", bad_seed), parallel=False, max_abs_reward=1.5e308)
    hit = [t for t in result.trajectories if t.seed == bad_seed]
    for t in hit:
        assert t.stop_reason == StopReason.ERROR, (t.stop_reason, t.error)
        assert "the episode's reward came to inf, not a finite number, with the reward 1e+308 (tag Bad, step 2 " \
               "of the episode" in t.error, t.error
    assert all(math.isfinite(t.reward) for t in result.trajectories)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_abs_reward", [1e6, 1.5e308])
def test_huge_rewards_never_make_the_trainers_advantages_nan(reference, max_abs_reward):
    """1e308 twice (issue 58): the env ends in error, its group is left out, and every advantage
    the trainer gets is a number."""
    from ragen.llm.scripted import byte_chat
    from ragen.rollout.context import ContextManager
    from ragen.trainer.config import TrainerConfig
    from ragen.trainer.samples import make_samples

    _, bad_seed = reference
    setup = AgentSetup.from_config(config(bad_tag("huge_reward", bad_seed), False, max_abs_reward=max_abs_reward))
    with LLMAgentProxy(setup, ScriptedEngine()) as proxy:
        result = proxy.next_train_batch(0)
    bad_group = next(t.group_id for t in result.trajectories if t.seed == bad_seed)
    assert result.dropped_groups == {bad_group: "failed"}
    samples, metrics = make_samples(result, ContextManager(setup.loop.context), byte_chat(), TrainerConfig(),
                                    setup.loop.context)
    assert len({s.group_key for s in samples}) == N_GROUPS - 1
    assert all(math.isfinite(s.advantage) and math.isfinite(s.score) for s in samples)
    assert all(math.isfinite(v) for v in metrics.values()), metrics


def test_the_reward_bound_is_checked_in_the_config():
    with pytest.raises(ValueError, match=r"es_manager.max_abs_reward must be > 0.0, got 0"):
        AgentSetup.from_config(config(bad_tag(), False, max_abs_reward=0))
    with pytest.raises(ValueError, match=r"es_manager.format_penalty=-5 is beyond es_manager.max_abs_reward=1"):
        AgentSetup.from_config(config(bad_tag(), False, max_abs_reward=1.0, format_penalty=-5.0))
