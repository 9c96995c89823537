"""An agent episode's training samples (``agent.sample_shape``): one per segment or one per call,
each exactly the ids the gateway recorded, and the episode's advantage shared by all of them."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ragen.gateway.record import prompt_ids
from ragen.llm.scripted import ScriptedEngine
from ragen.rollout.agent_episode import play_agent
from ragen.rollout.context import ContextConfig, ContextManager
from ragen.rollout.types import EnvSpec, RolloutResult
from ragen.trainer.config import TrainerConfig
from tests.agent_programs import growing_chat
from ragen.trainer.core import compute_advantages
from ragen.trainer.samples import make_samples
from tests.test_gateway import serve

pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")

ACTIONS = "Available actions: Up, Down."


def task(seed: int) -> dict:
    return {"a": seed, "b": 1}


def grows(task: dict, llm) -> float:
    """One segment: a chat of two calls, the second extending the first."""
    growing_chat(llm, f"Add {task['a']} and {task['b']}. {ACTIONS}", "Again.")
    return 0.0


def rewrites(task: dict, llm) -> float:
    """Two segments: the chat of ``grows``, then a call that compacts its history into one message."""
    _, second = growing_chat(llm, f"Add {task['a']} and {task['b']}. {ACTIONS}", "Again.")
    summary = f"You answered {second!r} so far. {ACTIONS} Go on."
    llm.client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": summary}])
    return 1.0


@pytest.fixture(scope="module")
def gateway():
    with serve(engine=ScriptedEngine()) as server:
        yield server


def agent_spec(entry: str, env_id: int, group_id: int = 0) -> EnvSpec:
    return EnvSpec(env_id=env_id, group_id=group_id, tag=entry.capitalize(), seed=3, env_type="agent",
                   env_config={"entry": f"tests.test_agent_samples:{entry}", "tasks": "tests.test_agent_samples:task",
                               "timeout_s": 30})


def played(server, spec, monkeypatch):
    """``play_agent``'s trajectory of ``spec``, and its session's records as the gateway kept them."""
    opened = []
    open_session = server.open_session
    monkeypatch.setattr(server, "open_session", lambda **kw: opened.append(open_session(**kw)) or opened[-1])
    traj = play_agent(spec, server, max_abs_reward=100.0)
    monkeypatch.undo()
    return traj, list(opened[0].records)


def nan_free(xs):
    """NaN as None, so that lists with NaN compare."""
    return [None if math.isnan(x) else x for x in xs]


def recorded_row(records, turns):
    """The training row the gateway's ``records`` give for the calls ``turns`` (one chain of a
    segment, or one call): ``(input_ids, loss_mask, behaviour_logprobs)``, the first call's whole
    prompt, then each call's sampled ids (mask 1, their log-probs) and what the next call's prompt
    adds (mask 0, NaN)."""
    ids, mask, behaviour = [], [], []
    for k in turns:
        prompt = prompt_ids(records, k)
        assert prompt[:len(ids)] == ids, f"call {k}'s prompt does not extend the row before it"
        added = prompt[len(ids):]
        ids += added + list(records[k].response_ids)
        mask += [0] * len(added) + [1] * len(records[k].response_ids)
        behaviour += [math.nan] * len(added) + list(records[k].logprobs)
    return ids, mask, behaviour


def assert_rows_are_the_records(rows, records):
    """Every row is exactly the ids, loss mask and behaviour log-probs the gateway recorded for its
    calls, and the rows train every call's sampled ids once."""
    for row in rows:
        ids, mask, behaviour = recorded_row(records, row["turns"])
        assert row["input_ids"] == ids and row["loss_mask"] == mask, row["turns"]
        assert nan_free(row["behaviour_logprobs"]) == nan_free(behaviour), row["turns"]
    assert sorted(k for row in rows for k in row["turns"]) == list(range(len(records)))


def rows_of(chat, shape, episodes, max_length=None):
    ctx = ContextManager(ContextConfig(agent_sample_shape=shape))
    return ctx.formulate_rollouts([(spec, traj.turns) for spec, traj in episodes], chat, max_length)


@pytest.mark.timeout(60)
def test_a_segment_is_a_sample_of_the_ids_the_gateway_recorded(gateway, monkeypatch):
    spec = agent_spec("rewrites", 0)
    traj, records = played(gateway, spec, monkeypatch)
    assert [r.segment for r in records] == [0, 0, 1] and records[2].cause is not None
    [rows] = rows_of(gateway.gateway.link.chat, "segment", [(spec, traj)])
    first, second = rows
    n0, n1, n2 = (len(r.response_ids) for r in records)
    assert min(n0, n1, n2) > 0
    # the segment's last prompt and answer; the model's own ids in the loss, each with its log-prob
    assert first["input_ids"] == prompt_ids(records, 1) + records[1].response_ids
    assert first["loss_mask"] == ([0] * len(prompt_ids(records, 0)) + [1] * n0
                                  + [0] * len(records[1].prompt_added) + [1] * n1)
    nan = math.nan
    assert nan_free(first["behaviour_logprobs"]) == nan_free(
        [nan] * len(prompt_ids(records, 0)) + records[0].logprobs + [nan] * len(records[1].prompt_added)
        + records[1].logprobs)
    assert second["input_ids"] == prompt_ids(records, 2) + records[2].response_ids
    assert second["loss_mask"] == [0] * len(prompt_ids(records, 2)) + [1] * n2
    assert nan_free(second["behaviour_logprobs"]) == nan_free([nan] * len(prompt_ids(records, 2)) + records[2].logprobs)
    # the episode's reward at each segment's last sampled token, nowhere else
    for row in rows:
        assert [(i, r) for i, r in enumerate(row["token_rewards"]) if r] == [(len(row["input_ids"]) - 1, 1.0)]
    assert [row["turns"] for row in rows] == [[0, 1], [2]]


@pytest.mark.timeout(60)
def test_a_call_is_a_sample_of_its_whole_prompt_and_its_answer(gateway, monkeypatch):
    spec = agent_spec("rewrites", 0)
    traj, records = played(gateway, spec, monkeypatch)
    [rows] = rows_of(gateway.gateway.link.chat, "call", [(spec, traj)])
    assert len(rows) == len(records) == 3
    for i, (row, record) in enumerate(zip(rows, records)):
        prompt = prompt_ids(records, i)
        assert row["input_ids"] == prompt + record.response_ids
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(record.response_ids)
        assert nan_free(row["behaviour_logprobs"]) == nan_free([math.nan] * len(prompt) + record.logprobs)
        assert [(k, r) for k, r in enumerate(row["token_rewards"]) if r] == [(len(row["input_ids"]) - 1, 1.0)]
        assert row["turns"] == [i]
    # cut at max_length each on its own
    [cut] = rows_of(gateway.gateway.link.chat, "call", [(spec, traj)], max_length=len(rows[0]["input_ids"]) - 1)
    assert [len(r["input_ids"]) for r in cut] == [min(len(r["input_ids"]), len(rows[0]["input_ids"]) - 1)
                                                  for r in rows]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape, per_episode", [("segment", (2, 1)), ("call", (3, 2))])
def test_the_advantage_is_the_episodes_shared_by_its_samples(gateway, monkeypatch, shape, per_episode):
    """A group of two episodes, one of two segments: the group's mean and std are of 2 scores, not 3."""
    specs = [agent_spec("rewrites", 0), agent_spec("grows", 1)]
    trajs = [played(gateway, s, monkeypatch)[0] for s in specs]
    later = dataclasses.replace(trajs[0].turns[2], policy_version=4)  # the second segment's call, a later policy
    trajs[0].turns[2] = later
    result = RolloutResult(trajectories=trajs, specs=specs)
    context = ContextConfig(agent_sample_shape=shape)
    samples, metrics = make_samples(result, ContextManager(context), gateway.gateway.link.chat, TrainerConfig(),
                                    context)
    want = compute_advantages([1.0, 0.0], [0, 0], ["Rewrites", "Grows"], context)
    assert want[0] == pytest.approx(1.0, abs=1e-5) and want[1] == pytest.approx(-1.0, abs=1e-5)
    n_a, n_b = per_episode
    assert [s.advantage for s in samples] == pytest.approx([want[0]] * n_a + [want[1]] * n_b)
    assert [s.score for s in samples] == [1.0] * n_a + [0.0] * n_b
    assert [s.policy_version for s in samples][:n_a] == ([0, 4] if shape == "segment" else [0, 0, 4])
    assert metrics["batch/n_samples"] == n_a + n_b and metrics["batch/n_episodes"] == 2
    assert metrics["batch/agent_segments"] == 3 and metrics["batch/kept_groups"] == 1
    n_turns = sum(len(t.turns) for t in trajs)
    sampled = sum(len(t.response_ids) for traj in trajs for t in traj.turns)
    assert metrics["response_length/mean"] == pytest.approx(sampled / n_turns)
    assert sum(s.num_loss_tokens for s in samples) == sampled
    # every trained token has the log-prob it was sampled with: the actor's logprob_token_frac is 1
    torch = pytest.importorskip("torch")
    from ragen.trainer.core import importance_weights, loss_positions

    behaviour = torch.tensor([x for s in samples for x in s.behaviour_logp])
    assert len(behaviour) == sum(len(loss_positions(s)) for s in samples)
    _, stats = importance_weights(torch.zeros_like(behaviour), behaviour, "tis", 2.0)
    assert stats.tokens / sum(s.num_loss_tokens for s in samples) == 1.0


@pytest.mark.timeout(60)
def test_groups_are_filtered_and_counted_by_episodes(gateway, monkeypatch):
    """Two groups; the one whose episodes all scored alike is dropped by ``rollout_filter_ratio``."""
    specs = [agent_spec("rewrites", 0, 0), agent_spec("grows", 1, 0), agent_spec("grows", 2, 1),
             agent_spec("grows", 3, 1)]
    trajs = [played(gateway, s, monkeypatch)[0] for s in specs]
    cfg = TrainerConfig()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, rollout_filter_ratio=0.5))
    context = ContextConfig()
    samples, metrics = make_samples(RolloutResult(trajectories=trajs, specs=specs), ContextManager(context),
                                    gateway.gateway.link.chat, cfg, context)
    assert {s.group_key for s in samples} == {0} and len(samples) == 3
    assert (metrics["batch/n_groups"], metrics["batch/kept_groups"], metrics["batch/n_episodes"]) == (2, 1, 2)


def test_calls_in_flight_at_once_on_one_segment_each_train_their_own_sequence():
    """Two calls extend the same call (an agent's parallel calls): the segment branches, and each
    branch is a row of its own, every row the ids the gateway recorded."""
    from ragen.agents.result import ProgramResult
    from ragen.gateway.record import CallRecord
    from ragen.rollout.agent_episode import trajectory_of

    def call(index, segment, start, added, sampled, cause=None):
        return CallRecord(index=index, endpoint="chat.completions", segment=segment, cause=cause,
                          prompt_start=start, prompt_added=added, response_ids=sampled,
                          logprobs=[-0.5] * len(sampled), finish_reason="stop")

    records = [call(0, 0, 0, [1, 2], [3], "first"),
               call(1, 0, 3, [4], [5, 6]),  # extends call 0
               call(2, 0, 3, [7], [8]),  # extends call 0 too, in flight with call 1
               call(3, 0, 5, [9], [10]),  # extends call 2, the last answered
               call(4, 1, 0, [11], [12], "history_truncated")]
    spec = agent_spec("grows", 0)
    traj = trajectory_of(spec, records, ProgramResult(reward=2.0), str)
    [rows] = rows_of(None, "segment", [(spec, traj)])
    assert [row["turns"] for row in rows] == [[0, 1], [2, 3], [4]]
    assert_rows_are_the_records(rows, records)
    for row in rows:
        last = row["turns"][-1]
        assert row["input_ids"] == prompt_ids(records, last) + records[last].response_ids
    assert rows[1]["loss_mask"] == [0, 0, 0, 0, 1, 0, 1]  # call 0's answer is call 2's prompt here
