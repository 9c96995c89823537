"""An env's reset/step values are checked where the loop takes them: an
observation that is not text, a reward that is text, or a NaN reward ends that
env in ``error`` (named by tag and seed), and the other envs and the rollout's
metrics are untouched, on the sequential path and on a parallel backend."""

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


def config(tag: dict, parallel: bool) -> dict:
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
        },
    }


def rollout(tag: dict, parallel: bool):
    with LLMAgentProxy(AgentSetup.from_config(config(tag, parallel)), ScriptedEngine()) as proxy:
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

