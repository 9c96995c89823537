"""An agent episode's calls kept linearly (each call's added messages, its segment's tools, its
answer), in the gateway's records and in the trajectory, the dump, the viewer and the replay
that checks the recorded tokens against the chat template."""

from __future__ import annotations

import dataclasses
import html
import json
import logging
import re

import pytest

from ragen.gateway.calls import read_chat
from ragen.gateway.recording import SessionRecorder, read_session
from ragen.gateway.segments import BREAKS
from ragen.llm.scripted import ScriptedEngine, byte_chat
from ragen.rollout.agent_episode import play_agent
from ragen.rollout.dump import DumpError, read_dump, write_dump
from ragen.llm.types import SamplingParams
from ragen.rollout.loop_config import LoopConfig
from ragen.rollout.types import EnvSpec, RolloutResult, StopReason, rollout_digest
from ragen.tools import replay as replay_tool
from ragen.viewer import render_html, write_viewer
from tests.test_gateway import SYSTEM, TOOLS, client_of, serve
from tests.test_viewer import _chromium, browser  # noqa: F401 - the real browser the viewer's tests use

pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")

EVIL = '<img src=x onerror="document.body.setAttribute(\'data-pwned\',\'1\')"><script>alert(1)</script>'


def weather_agent(task: dict, llm) -> dict:
    """Calls the weather tool, answers the result (the call extends its segment), then asks again
    with its first question rewritten (a new segment, history_rewritten). Its info holds the
    messages of each call as it sent them."""
    sent = []

    def call(messages, **kw):
        sent.append(json.loads(json.dumps(messages)))
        return llm.client.chat.completions.create(model=llm.model, messages=messages, tools=TOOLS, **kw)

    question = {"role": "user", "content": f"Weather in {task['city']}? {EVIL}"}
    messages = [SYSTEM, question]
    first = call(messages).choices[0].message
    (tool_call,) = first.tool_calls
    messages += [{"role": "assistant", "content": first.content,
                  "tool_calls": [{"id": tool_call.id, "type": "function",
                                  "function": {"name": tool_call.function.name,
                                               "arguments": tool_call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": tool_call.id, "content": f"weather_result: sunny {EVIL}"}]
    second = call(messages).choices[0].message
    messages += [{"role": "assistant", "content": second.content}, {"role": "user", "content": "Thanks."}]
    messages[1] = {"role": "user", "content": "Weather in Lyon?"}
    call(messages)
    print(f"done {EVIL}")
    return {"reward": 0.75, "sent": sent}


def grow_then_rewrite(task: dict, llm) -> float:
    """A chat that grows for two calls, then one whose first question is rewritten."""
    messages = [SYSTEM, {"role": "user", "content": f"Weather in {task['city']}?"}]
    for turn in range(2):
        answer = llm.client.chat.completions.create(model=llm.model, messages=messages).choices[0].message
        messages += [{"role": "assistant", "content": answer.content}, {"role": "user", "content": f"And {turn}?"}]
    messages[1] = {"role": "user", "content": "Weather in Lyon?"}
    llm.client.chat.completions.create(model=llm.model, messages=messages)
    return 1.0


def text_then_chat(task: dict, llm) -> float:
    """A completions call (a text prompt), then a chat call."""
    llm.client.completions.create(model=llm.model, prompt=f"Weather in {task['city']}?")
    llm.client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "Hi."}])
    return 0.5


@pytest.fixture(scope="module")
def gateway():
    with serve() as server:
        yield server


@pytest.fixture(scope="module")
def played(gateway, tmp_path_factory):
    tasks = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    tasks.write_text(json.dumps({"city": "Paris"}) + "\n")
    spec = EnvSpec(env_id=4, group_id=1, tag="Weather", seed=0, env_type="agent",
                   env_config={"entry": "tests.test_agent_view:weather_agent", "tasks": str(tasks), "timeout_s": 30})
    traj = play_agent(spec, gateway, max_abs_reward=100.0)
    assert traj.stop_reason == StopReason.DONE, traj.error
    return spec, traj, traj.program["info"]["sent"]


@pytest.fixture(scope="module")
def dumped(played, tmp_path_factory):
    spec, traj, _ = played
    return write_dump(tmp_path_factory.mktemp("run"), "step_000000", RolloutResult([traj], [spec]), LoopConfig(),
                      "train", 0)


def shown_and_said(messages, tools=TOOLS):
    call = read_chat({"messages": messages, "tools": tools}, 100)
    return call.shown, call.said


# ----------------------------------------------------------------------------- what is kept


@pytest.mark.timeout(60)
def test_a_call_record_keeps_what_the_call_added_and_the_session_file_reads_it_back(gateway, tmp_path):
    session = gateway.open_session()
    client = client_of(gateway, session)
    messages = [SYSTEM, {"role": "user", "content": "Weather?"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
    call = first.tool_calls[0]
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "weather_result: rain"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
    gateway.gateway.sessions.close(session.id)
    a, b = session.records
    assert (a.cause, b.cause) == ("first", None)
    assert a.messages == [SYSTEM, {"role": "user", "content": "Weather?"}] and a.tools == TOOLS
    # the call that extends: only what follows the answer it repeated, and no tools (its segment's are kept)
    assert b.messages == [{"role": "tool", "content": "weather_result: rain", "tool_call_id": call.id}]
    assert b.tools is None
    assert a.answer == {"role": "assistant", "content": first.content or "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert b.answer == {"role": "assistant", "content": second.content} and "sunny in Paris" in second.content
    recorder = SessionRecorder(tmp_path)
    recorder(session)
    assert read_session(recorder.path(session.id)).records == session.records


@pytest.mark.timeout(60)
def test_an_agent_turn_holds_its_calls_added_messages_tools_and_answer(played):
    spec, traj, sent = played
    first, second, third = traj.turns
    assert json.loads(first.observation) == sent[0] and first.info["tools"] == TOOLS
    assert first.info["cause"] == "first" and first.tool_calls[0]["function"]["name"] == "get_weather"
    # after the echoed answer: the tool's result alone
    assert [m["role"] for m in json.loads(second.observation)] == ["tool"] and second.info["cause"] is None
    assert "tools" not in second.info and second.tool_calls is None
    assert "It is sunny in Paris." in second.info["content"] and "<tool_call>" not in first.info["content"]
    # the rewritten question starts a segment: all its messages, its tools again
    assert third.info["cause"] == "history_rewritten" and third.info["tools"] == TOOLS
    assert shown_and_said(json.loads(third.observation)) == shown_and_said(sent[2])
    assert third.reward == 0.75 and len(sent) == 3


@pytest.mark.timeout(60)
def test_an_agent_episode_played_again_gives_the_same_turns(gateway, played):
    spec, traj, _ = played
    again = play_agent(spec, gateway, max_abs_reward=100.0)
    # the tool call ids the agent repeats are the session's request key's, not its random id
    assert again.turns == traj.turns and rollout_digest([again]) == rollout_digest([traj])
    assert json.loads(again.turns[1].observation)[0]["tool_call_id"] == "call_0_4_0_0"


# ----------------------------------------------------------------------------- the dump


@pytest.mark.timeout(60)
def test_an_agent_dump_reads_back_with_each_calls_messages_as_sent(played, dumped):
    spec, traj, sent = played
    (record,) = read_dump(dumped)
    assert record.trajectory.turns == traj.turns
    # each turn's prompt is its call's messages as the agent sent them (the template renders them alike)
    for i, messages in enumerate(sent):
        assert shown_and_said(list(record.messages[i])) == shown_and_said(messages), i
    # written linearly: the call that extends keeps the messages before it and adds the answer and the result
    row = json.loads(dumped.read_text())
    assert [t["prompt"]["from_previous"] for t in row["turns"]] == [0, 2, 1]


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update(observation="not json"), "turns[1].observation: not the JSON of an agent call's messages"),
    (lambda t: t.update(observation='[{"role": 3}]'), "turns[1].observation: message 0 is dict"),
    (lambda t: t["info"].update(segment="0"), "turns[1].info.segment: expected int"),
    (lambda t: t["info"].update(tools="all"), "turns[1].info.tools: expected list"),
])
def test_a_malformed_agent_turn_is_refused_naming_it(dumped, tmp_path, change, message):
    row = json.loads(dumped.read_text())
    change(row["turns"][1])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(DumpError, match=re.escape(message)):
        read_dump(bad)


# ----------------------------------------------------------------------------- the viewer


@pytest.mark.timeout(60)
def test_the_viewer_shows_each_call_escaped_with_its_segments_tokens_and_reward(dumped, caplog):
    records = read_dump(dumped)
    with caplog.at_level(logging.INFO):
        page = render_html(records)
    assert not [r for r in caplog.records if "agent" in r.getMessage()], caplog.text  # no warning for an agent
    assert "<script>alert" not in page and "<img src=x" not in page
    calls = re.findall(r'<li class="turn call" data-turn="(\d)" data-call="(\d)" data-segment="(\d)"', page)
    assert calls == [("0", "0", "0"), ("1", "1", "0"), ("2", "2", "1")]
    # where a segment starts, and why: the prefix break made visible, with what it means
    starts = re.findall(r'<p class="segment-start ([a-z-]+)" data-cause="([a-z_]+)">', page)
    assert starts == [("first", "first"), ("prefix-break", "history_rewritten")]
    assert html.escape(BREAKS["history_rewritten"]) in page
    turns = records[0].trajectory.turns
    parts = page.split('<li class="turn call"')[1:]
    # the added messages, by role, escaped; the tool call and the result that answers it
    assert html.escape(f"Weather in Paris? {EVIL}") in parts[0] and '<b>system</b>' in parts[0]
    assert '<code class="tool-name">get_weather</code>' in parts[0]
    assert html.escape(f"weather_result: sunny {EVIL}") in parts[1] and "<b>tool</b> · answers" in parts[1]
    assert "1 messages added (after the 3 messages its segment held)" in parts[1]
    for part, turn in zip(parts, turns):
        # the trained tokens: the ids sampled (mask 1), apart from the prompt's added ids (mask 0)
        sampled = " ".join(map(str, turn.response_ids))
        added = " ".join(map(str, turn.prompt_ids))
        assert f'<code class="ids trained" data-mask="1">{sampled}</code>' in part
        assert f'<code class="ids" data-mask="0">{added}</code>' in part
        assert f'<pre class="answer trained" data-mask="1">{html.escape(turn.response)}</pre>' in part
    assert '<span class="reward">reward 0.750</span>' in parts[2]
    assert '<span class="reward">' not in parts[0] + parts[1]
    # the program's output, escaped
    assert html.escape(f"done {EVIL}") in page and '<details class="program-stdout">' in page


def test_a_turn_that_is_not_an_agent_call_is_shown_as_such(dumped):
    (record,) = read_dump(dumped)
    bad = dataclasses.replace(record.trajectory.turns[0], observation=EVIL)
    page = render_html([dataclasses.replace(record, trajectory=dataclasses.replace(
        record.trajectory, turns=[bad, *record.trajectory.turns[1:]]))])
    assert "not an agent call: turns[0].observation" in page and "<img src=x" not in page


@pytest.mark.timeout(1200)  # the first may install chromium
def test_the_browser_runs_the_agent_page_and_runs_nothing_the_model_or_program_wrote(browser, dumped,  # noqa: F811
                                                                                      tmp_path):
    out = write_viewer(dumped, tmp_path / "page.html")
    res = _chromium(browser, tmp_path, "--dump-dom", out.as_uri() + "#ep-4")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert re.search(r'<body[^>]*data-ready="1"', dom) and not re.search(r"<body[^>]*data-pwned", dom)
    assert not re.search(r"<img[^>]*onerror", dom) and dom.count('class="turn call"') == 3
    assert re.search(r'<details class="episode" id="ep-4"[^>]* open', dom)  # the hash opened it


# ----------------------------------------------------------------------------- the replay


def test_the_recorded_tokens_match_the_template(dumped):
    (record,) = read_dump(dumped)
    result = replay_tool.replay_agent(record, byte_chat())
    assert result.identical and result.calls == 3 and result.drifts == []


def test_a_template_drift_is_reported_naming_the_call(dumped):
    (record,) = read_dump(dumped)
    plain = byte_chat()
    # another template: every segment's first call differs
    other = type(plain)(lambda m, g: "[v2]" + plain.render(m, g), plain.encode, plain.end_texts, "v2")
    result = replay_tool.replay_agent(record, other)
    assert [d.split(":")[0] for d in result.drifts] == ["call 0 (segment 0, first)",
                                                         "call 2 (segment 1, history_rewritten)"]
    assert "prompt ids: the dump has" in result.drifts[0] and "template" in result.drifts[0]
    # a recorded id changed in the call that extends: that call alone
    turns = record.trajectory.turns
    changed = dataclasses.replace(turns[1], prompt_ids=(7,) + turns[1].prompt_ids[1:])
    tampered = dataclasses.replace(record, trajectory=dataclasses.replace(record.trajectory,
                                                                          turns=[turns[0], changed, turns[2]]))
    result = replay_tool.replay_agent(tampered, plain)
    assert len(result.drifts) == 1 and result.drifts[0].startswith("call 1 (segment 0, extends it): prompt ids: ")


@pytest.mark.timeout(300)
def test_an_agent_episode_on_a_real_tokenizer_replays_with_the_models_template(tiny_model_path, tmp_path, capsys):
    from ragen.llm import make_engine

    (tmp_path / "tasks.jsonl").write_text(json.dumps({"city": "Paris"}) + "\n")
    spec = EnvSpec(env_id=0, group_id=0, tag="Grow", seed=0, env_type="agent",
                   env_config={"entry": "tests.test_agent_view:grow_then_rewrite",
                               "tasks": str(tmp_path / "tasks.jsonl"), "timeout_s": 120})
    with serve(engine=make_engine({"name": "hf", "device": "cpu"}, tiny_model_path),
               sampling=SamplingParams(max_tokens=12)) as server:
        traj = play_agent(spec, server, max_abs_reward=100.0)
    assert traj.stop_reason == StopReason.DONE, traj.error
    assert [t.info["cause"] for t in traj.turns] == ["first", None, "history_rewritten"]
    path = write_dump(tmp_path, "step_000000", RolloutResult([traj], [spec]), LoopConfig(), "train", 0)
    # --model alone: the model's tokenizer and chat template, no weights loaded
    assert replay_tool.main([str(path), "--model", tiny_model_path]) == 0
    assert capsys.readouterr().out == "env 0 (Grow, seed 0, 3 calls): tokens match the template (3 chat calls)\n"


@pytest.mark.timeout(60)
def test_a_completions_call_keeps_no_messages_is_drawn_as_text_and_carried_by_the_replay(gateway, tmp_path):
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"city": "Paris"}) + "\n")
    spec = EnvSpec(env_id=2, group_id=0, tag="Text", seed=0, env_type="agent",
                   env_config={"entry": "tests.test_agent_view:text_then_chat",
                               "tasks": str(tmp_path / "tasks.jsonl"), "timeout_s": 30})
    traj = play_agent(spec, gateway, max_abs_reward=100.0)
    text, chat = traj.turns
    assert text.observation == "" and text.info["endpoint"] == "completions" and "content" not in text.info
    assert chat.info["cause"] == "history_rewritten" and json.loads(chat.observation) == [
        {"role": "user", "content": "Hi."}]
    (record,) = read_dump(write_dump(tmp_path, "d", RolloutResult([traj], [spec]), LoopConfig(), "train", 0))
    assert "a completions call: its prompt is text" in render_html([record])
    result = replay_tool.replay_agent(record, byte_chat())
    assert result.identical and result.calls == 1


def test_the_replay_command_checks_an_agent_dump(dumped, tmp_path, capsys):
    assert replay_tool.main([str(dumped), "--engine", "scripted"]) == 0
    assert capsys.readouterr().out == "env 4 (Weather, seed 0, 3 calls): tokens match the template (3 chat calls)\n"
    row = json.loads(dumped.read_text())
    row["turns"][2]["prompt_ids"][5] += 1
    bad = tmp_path / "drift.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    assert replay_tool.main([str(bad), "--engine", "scripted"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("env 4 (Weather, seed 0, 3 calls): differs at call 2 (segment 1, history_rewritten): "
                          "prompt ids: ") and out.rstrip().endswith("(a template drift)")
    # no template to check them with: one error line naming the flags
    assert replay_tool.main([str(dumped)]) == 2
    assert "env 4: agent episodes" in capsys.readouterr().err
