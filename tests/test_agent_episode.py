"""``play_agent``: an agent tag's episode on a gateway, to a trajectory whose turns are the
gateway's records, trained exactly (every answer token with its log-prob)."""

from __future__ import annotations

import json
import math

import pytest

from ragen.llm.scripted import ScriptedEngine
from ragen.rollout.agent_episode import play_agent
from ragen.rollout.context import ContextConfig, ContextManager
from ragen.rollout.types import EnvSpec, StopReason, episode_ids
from tests.agent_programs import growing_chat
from tests.test_gateway import serve

pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")


def two_turns(task: dict, llm) -> dict:
    """A growing chat of two calls, then the reward with some information."""
    growing_chat(llm, f"Add {task['a']} and {task['b']}. Available actions: Up, Down.", "Again.")
    print(f"<b>added {task['a']}</b>")
    return {"reward": 0.5, "calls": 2}


def raises(task: dict, llm) -> float:
    llm.client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the agent fell over")


def never_calls(task: dict, llm) -> float:
    return 1.0


@pytest.fixture(scope="module")
def gateway():
    with serve(engine=ScriptedEngine()) as server:
        yield server


def spec(tmp_path, entry: str, seed: int = 3) -> EnvSpec:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"a": i, "b": 1}) for i in range(4)) + "\n")
    return EnvSpec(env_id=5, group_id=2, tag="Calc", seed=seed, env_type="agent",
                   env_config={"entry": f"tests.test_agent_episode:{entry}", "tasks": str(tasks), "timeout_s": 30})


@pytest.mark.timeout(60)
def test_an_agent_episode_is_a_trajectory_of_its_calls_trained_exactly(gateway, tmp_path):
    traj = play_agent(spec(tmp_path, "two_turns"), gateway, max_abs_reward=100.0)
    assert traj.stop_reason == StopReason.DONE and traj.error is None and traj.success
    assert (traj.env_id, traj.group_id, traj.tag, traj.seed) == (5, 2, "Calc", 3)
    first, second = traj.turns
    assert (first.reward, second.reward) == (0.0, 0.5)
    # the answer's content as the client got it: with no tools, the text as sampled
    assert first.info == {"call": 0, "segment": 0, "cause": "first", "endpoint": "chat.completions",
                          "content": first.response}
    assert second.info == {"call": 1, "segment": 0, "cause": None, "endpoint": "chat.completions",
                           "content": second.response}
    assert traj.program == {"info": {"calls": 2}, "traceback": None, "stdout": "<b>added 3</b>\n", "stderr": ""}
    assert first.prompt_start == 0 and second.prompt_start == len(first.prompt_ids) + len(first.response_ids)
    assert all(len(t.logprobs) == len(t.response_ids) > 0 for t in traj.turns)
    chat = gateway.gateway.link.chat
    ((sample,),) = ContextManager(ContextConfig()).formulate_rollouts([(spec(tmp_path, "two_turns"), traj.turns)], chat)
    assert sample["input_ids"] == episode_ids(traj.turns)  # the ids sampled and sent, as they were
    trained = [b for b, m in zip(sample["behaviour_logprobs"], sample["loss_mask"]) if m]
    assert len(trained) == sum(len(t.response_ids) for t in traj.turns) and not any(map(math.isnan, trained))
    assert sample["token_rewards"][-1] == 0.5


@pytest.mark.timeout(60)
def test_the_members_of_a_group_get_the_same_task_and_sample_alike(gateway, tmp_path):
    a, b = (play_agent(spec(tmp_path, "two_turns", seed=7), gateway, max_abs_reward=100.0) for _ in range(2))
    assert [t.response_ids for t in a.turns] == [t.response_ids for t in b.turns]  # same key: same samples
    shown = [gateway.gateway.link.decode_text(list(t.turns[0].prompt_ids)) for t in (a, b)]
    assert all("Add 3 and 1." in text for text in shown)  # seed 7: the tasks' line 7 % 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entry, error", [("raises", "the agent fell over"), ("never_calls", "made no call")])
def test_an_agent_that_fails_or_never_calls_ends_in_error(gateway, tmp_path, entry, error):
    traj = play_agent(spec(tmp_path, entry), gateway, max_abs_reward=100.0)
    assert traj.stop_reason == StopReason.ERROR and error in traj.error
    # what the program left goes with its trajectory (and the dump): the traceback where it raised
    assert (traj.program["traceback"] or "").endswith("RuntimeError: the agent fell over\n") == (entry == "raises")
    assert len(gateway.gateway.sessions) == 0  # every episode's session is closed with it
