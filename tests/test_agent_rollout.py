"""``env_type: agent`` tags in a rollout: their episodes played beside env episodes by every
backend (sequential in the driver; loky, threading workers with a gateway each), the same
trajectories whichever plays them."""

from __future__ import annotations

import os

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.rollout.types import StopReason, rollout_digest
from tests.rollout_helpers import custom_envs

pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")

COUNT_AGENT = {"env_type": "agent", "env_config": {"entry": "tests.agent_programs:counts",
                                                   "tasks": "tests.agent_programs:task_of", "timeout_s": 60}}


def setup(**agent_proxy) -> AgentSetup:
    split = {"env_groups": 4, "group_size": 2,
             "env_configs": {"tags": ["SimpleSokoban", "CountAgent"], "n_groups": [2, 2]}}
    return AgentSetup.from_config({
        "custom_envs": custom_envs(CountAgent=COUNT_AGENT),
        "seed": {"train": 3, "val": 11},
        "agent_proxy": {"max_turn": 2, **agent_proxy},
        "es_manager": {"train": split, "val": {**split, "env_groups": 2, "env_configs": {
            "tags": ["CountAgent"], "n_groups": [2]}}},
    })


def rollout(**agent_proxy):
    with LLMAgentProxy(setup(**agent_proxy), ScriptedEngine(malformed_rate=0.1)) as proxy:
        return proxy.rollout("train")


@pytest.mark.timeout(120)
def test_agent_episodes_play_beside_env_episodes_the_same_sequential_or_parallel():
    seq = rollout(use_parallel_rollout=False)
    agents = [t for t in seq.trajectories if t.tag == "CountAgent"]
    assert [t.env_id for t in seq.trajectories] == list(range(8)) and len(agents) == 4
    for t in agents:
        assert t.stop_reason == StopReason.DONE and t.error is None, t.error
        assert len(t.turns) == 2 and t.turns[1].prompt_start > 0  # one segment: the second call extends the first
        assert t.program["info"]["seen"] == t.seed  # the task its seed picks (tests.agent_programs:task_of)
    assert agents[0].seed == agents[1].seed != agents[2].seed  # a group shares its task
    digest = rollout_digest(seq.trajectories)
    for backend in ("loky", "threading"):
        par = rollout(use_parallel_rollout=True, parallel_backend=backend, parallel_n_jobs=2)
        assert rollout_digest(par.trajectories) == digest, backend


@pytest.mark.parametrize("key, value, says", [("rollout_mode", "fully_async", "agent_proxy.rollout_mode=fully_async"),
                                              ("over_sample", 1.5, "agent_proxy.over_sample=1.5")])
def test_what_agent_tags_cannot_do_is_refused_at_start_up_naming_the_key(key, value, says):
    with pytest.raises(ValueError, match=says.replace(".", r"\.")) as info:
        setup(use_parallel_rollout=True, **{key: value})
    assert "CountAgent" in str(info.value)


@pytest.mark.parametrize("env_config, key", [
    ({"entry": "tests.agent_programs:nowhere", "tasks": "tests.agent_programs:task_of"}, "env_config.entry"),
    ({"entry": "tests.agent_programs:counts", "tasks": "/nonexistent/tasks.jsonl"}, "env_config.tasks"),
])
def test_a_bad_agent_tag_is_refused_at_start_up_naming_its_key(env_config, key):
    with pytest.raises(ValueError, match=rf"custom_envs\.CountAgent\.{key.replace('.', chr(92) + '.')}"):
        AgentSetup.from_config({"custom_envs": custom_envs(CountAgent={"env_type": "agent", "env_config": env_config}),
                                "es_manager": {"train": {"env_groups": 1, "group_size": 1, "env_configs": {
                                    "tags": ["CountAgent"], "n_groups": [1]}}}})


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend, package", [("dask", "distributed"), ("ray", "ray")])
def test_on_a_cluster_agent_episodes_are_the_sequential_ones(backend, package):
    pytest.importorskip(package)
    seq = rollout(use_parallel_rollout=False)
    par = rollout(use_parallel_rollout=True, parallel_backend=backend, parallel_n_jobs=2)
    assert rollout_digest(par.trajectories) == rollout_digest(seq.trajectories)
    assert {t.worker for t in par.trajectories if t.tag == "CountAgent"}.isdisjoint({os.getpid()})


@pytest.mark.timeout(120)
def test_a_tokenizer_that_cannot_travel_to_the_workers_is_said_once_naming_the_way_out():
    from ragen.llm.chat_tokens import ChatTokens
    from ragen.llm.scripted import render_messages
    from ragen.rollout.backends.parallel import RolloutError

    engine = ScriptedEngine()
    engine.chat = ChatTokens(render_messages, lambda text: list(text.encode()), {}, "bare")  # closures only
    with LLMAgentProxy(setup(use_parallel_rollout=True, parallel_n_jobs=2), engine) as proxy:
        with pytest.raises(RolloutError, match="cannot be sent to the workers.*parallel_backend=threading"):
            proxy.rollout("train")
