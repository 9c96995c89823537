"""verifiers environments (prime-rl's verifiers 0.4.0, ``verifiers.v1``) as agent tags: a single-turn
taskset and a multi-turn one with an MCP tool play in a rollout on the scripted engine, the same
sequential or parallel; the reward is their rubric's, the rubric's scores and metrics are the
program's info; a tag that does not load is refused at start-up, naming its key.

verifiers pins the openai client below the one the dev extra's openai-agents needs: the module
runs in an environment of its own (docs/agents.md, *verifiers environments*) and skips without it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.llm.tool_calls import call_text
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.rollout.types import StopReason, rollout_digest
from tests.rollout_helpers import custom_envs

pytest.importorskip("verifiers.v1", reason="verifiers 0.4.0 (pip install 'verifiers==0.4.0', in a venv of its own)")

TASKSETS = Path(__file__).resolve().parent / "verifiers_tasksets"
SUMS = TASKSETS / "sums.jsonl"
SUM_TAG = {"env_type": "agent", "env_config": {"verifiers": {"taskset": "ragen_vf_sums", "dataset": str(SUMS)},
                                               "timeout_s": 120}}
CALC_TAG = {"env_type": "agent", "env_config": {"verifiers": {"taskset": "ragen_vf_calc",
                                                              "env": {"agent": {"max_turns": 4}}},
                                                "timeout_s": 120}}

CALC_TASKS = [(2, 3), (10, 20), (7, 8)]  # ragen_vf_calc's load()


def policy(prompt: str, rng) -> tuple[str, float] | None:
    """The scripted model: a sum that is right or off by one (the seed says which); with the add
    tool listed, a call of it first, then the sum its result gave."""
    asked = re.findall(r"add (\d+) and (\d+)", prompt) or re.findall(r"What is (\d+) \+ (\d+)", prompt)
    if not asked:
        return None
    a, b = map(int, asked[-1])
    off = rng.choice([0, 1])
    result = re.findall(r"sum=(\d+)", prompt)
    if result:
        return f"The sum is {result[-1]}.", -0.5
    if "calc_add" in prompt:
        return call_text("calc_add", {"a": a, "b": b + off}), -0.7
    return f"The sum is {a + b + off}.", -0.7


@pytest.fixture()
def tasksets(monkeypatch):
    """The test tasksets importable here, in the rollout's workers (they take this path) and in the
    tool servers verifiers starts (they take PYTHONPATH)."""
    monkeypatch.syspath_prepend(str(TASKSETS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(TASKSETS), os.environ.get("PYTHONPATH")) if p))


def setup(tag: str, spec: dict, groups: int, group_size: int, **agent_proxy) -> AgentSetup:
    split = {"env_groups": groups, "group_size": group_size, "env_configs": {"tags": [tag], "n_groups": [groups]}}
    return AgentSetup.from_config({
        "custom_envs": custom_envs(**{tag: spec}),
        "seed": {"train": 5, "val": 11},
        "agent_proxy": {"max_turn": 2, **agent_proxy},
        "es_manager": {"train": split, "val": split},
    })


def rollout(tag: str, spec: dict, groups: int, group_size: int, **agent_proxy):
    engine = ScriptedEngine(answers="tests.test_agent_verifiers:policy")
    with LLMAgentProxy(setup(tag, spec, groups, group_size, **agent_proxy), engine) as proxy:
        return proxy.rollout("train").trajectories


def same_in_parallel(tag: str, spec: dict, groups: int, group_size: int, sequential) -> None:
    parallel = rollout(tag, spec, groups, group_size, use_parallel_rollout=True, parallel_backend="loky",
                       parallel_n_jobs=2)
    assert rollout_digest(parallel) == rollout_digest(sequential)


def last_number(text: str) -> int:
    return int(re.findall(r"-?\d+", text)[-1])


@pytest.mark.timeout(300)
def test_a_single_turn_taskset_plays_as_an_agent_tag_scored_by_its_rubric(tasksets):
    trajectories = rollout("SumVF", SUM_TAG, groups=2, group_size=2)
    tasks = [json.loads(line) for line in SUMS.read_text().splitlines()]
    assert len(trajectories) == 4
    for t in trajectories:
        assert t.stop_reason == StopReason.DONE and t.error is None, t.error
        assert len(t.turns) == 1
        task = tasks[t.seed % len(tasks)]  # the dataset's line the seed picks
        right = last_number(t.turns[0].response) == task["a"] + task["b"]
        (trace,) = t.program["info"]["traces"]
        assert trace["rewards"] == {"correct": {"score": float(right), "weight": 2.0}}
        assert t.turns[-1].reward == trace["reward"] == 2.0 * right  # the rubric's weighted sum
        assert trace["metrics"]["reply_chars"] == len(t.turns[0].response.strip())
        assert trace["stop_condition"] is not None and trace["turns"] == 1
    assert {t.turns[-1].reward for t in trajectories} == {0.0, 2.0}  # the policy is right and wrong
    same_in_parallel("SumVF", SUM_TAG, 2, 2, trajectories)


@pytest.mark.timeout(400)
def test_a_tool_taskset_calls_its_mcp_tool_over_turns_and_is_scored_by_its_rubric(tasksets):
    trajectories = rollout("CalcVF", CALC_TAG, groups=2, group_size=1)
    assert len(trajectories) == 2
    for t in trajectories:
        assert t.stop_reason == StopReason.DONE and t.error is None, t.error
        assert len(t.turns) == 2 and "calc_add" in t.turns[0].response  # the call, then the answer
        assert t.turns[1].prompt_start > 0  # the tool's round trip extends the first call's segment
        (trace,) = t.program["info"]["traces"]
        assert trace["metrics"]["tool_calls"] == 1.0 and trace["turns"] == 2
        asked = json.loads(t.turns[0].response.split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]
        summed = last_number(t.turns[1].response)
        assert summed == asked["a"] + asked["b"]  # the answer is what the tool gave
        a, b = CALC_TASKS[t.seed % len(CALC_TASKS)]  # the task of the taskset's own load() the seed picks
        assert trace["rewards"]["correct"]["score"] == float(summed == a + b)
        assert t.turns[-1].reward == trace["reward"] == trace["rewards"]["correct"]["score"]
    same_in_parallel("CalcVF", CALC_TAG, 2, 1, trajectories)


@pytest.mark.timeout(120)
def test_an_episode_verifiers_ends_not_ok_ends_in_error_naming_why(tasksets):
    broken = {"taskset": {"task": {"rewards": {"broken": {"fn": "ragen_vf_sums:broken_reward"}}}}}
    spec = {"env_type": "agent", "env_config": {"verifiers": {**SUM_TAG["env_config"]["verifiers"], "env": broken},
                                                "timeout_s": 60}}
    (t,) = rollout("SumVF", spec, groups=1, group_size=1)
    assert t.stop_reason == StopReason.ERROR
    assert "the verifiers episode was not ok" in t.error and "this reward cannot score" in t.error
    assert "ValueError: this reward cannot score" in t.program["stderr"]  # its traceback


@pytest.mark.parametrize("verifiers, key, says", [
    ({"taskset": "ragen_vf_nowhere"}, "verifiers.taskset", "is not a verifiers taskset"),
    ({"taskset": "ragen_vf_sums", "dataset": "/nonexistent/sums.jsonl"}, "verifiers.dataset", "no file"),
    ({"taskset": "ragen_vf_sums"}, "verifiers.taskset", "could not load its tasks"),
    ({"taskset": "ragen_vf_sums", "dataset": "BAD_ROW"}, "verifiers.dataset", "line 2: 'c' is not a field of SumData"),
    ({"taskset": "ragen_vf_sums", "dataset": str(SUMS), "env": {"agent": {"max_turnz": 3}}}, "verifiers.env",
     "verifiers.env.agent.max_turnz: Extra inputs are not permitted"),
    ({"taskset": "ragen_vf_sums", "dataset": str(SUMS), "env": {"interception": {"type": "elastic"}}},
     "verifiers.env.interception", "ragen serves each episode's model calls"),
])
def test_a_verifiers_tag_that_does_not_load_is_refused_at_start_up_naming_its_key(tasksets, tmp_path, verifiers,
                                                                                  key, says):
    if verifiers.get("dataset") == "BAD_ROW":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"a": 1, "b": 2}\n{"a": 1, "c": 2}\n')
        verifiers = {**verifiers, "dataset": str(bad)}
    with pytest.raises(ValueError, match=rf"custom_envs\.SumVF\.env_config\.{re.escape(key)}.*{re.escape(says)}"):
        setup("SumVF", {"env_type": "agent", "env_config": {"verifiers": verifiers}}, 1, 1)


def test_a_verifiers_tag_takes_no_tasks_of_its_own(tasksets):
    spec = {"env_type": "agent", "env_config": {"verifiers": {"taskset": "ragen_vf_sums", "dataset": str(SUMS)},
                                                "tasks": str(SUMS)}}
    with pytest.raises(ValueError, match=r"custom_envs\.SumVF\.env_config\.tasks: a verifiers environment's tasks"):
        setup("SumVF", spec, 1, 1)
