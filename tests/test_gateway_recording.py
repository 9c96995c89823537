"""A gateway session's calls written as JSON lines when it closes (``ragen.gateway.recording``), and read
back into records from which every prompt rebuilds."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

import pytest

from ragen.gateway.gateway import Gateway, GatewaySettings
from ragen.gateway.link import ManagerLink
from ragen.gateway.record import prompt_ids
from ragen.gateway.recording import SessionRecorder, read_session
from ragen.gateway.server import GatewayServer
from ragen.gateway.session import Sessions
from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import SamplingParams
from ragen.serving.server import SharedLLMInferenceManager

openai = pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")

SYSTEM = {"role": "system", "content": "You are a helper. Available actions: Up, Down, Left, Right."}


@pytest.fixture
def recorded(tmp_path):
    """A gateway whose sessions are written to tmp_path/records as they close (idle ones expire fast)."""
    manager = SharedLLMInferenceManager(ScriptedEngine())
    link = ManagerLink.of(manager, timeout_s=30)
    recorder = SessionRecorder(tmp_path / "records")
    settings = GatewaySettings(session_ttl_s=0.2)
    sessions = Sessions(link.chat, settings.max_sessions, settings.session_ttl_s, on_close=recorder)
    server = GatewayServer(Gateway(link, SamplingParams(max_tokens=64), settings, sessions))
    yield server, recorder
    server.close()
    manager.close()


def _client(server, session):
    return openai.OpenAI(base_url=server.base_url(session), api_key=session.key, max_retries=0, timeout=30)


def _delete(server, session) -> int:
    request = urllib.request.Request(f"http://{server.host}:{server.port}/sessions/{session.id}", method="DELETE",
                                     headers={"Authorization": f"Bearer {server.key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status


@pytest.mark.timeout(60)
def test_a_closed_session_is_written_whole_and_every_prompt_rebuilds_from_its_file(recorded):
    server, recorder = recorded
    session = server.open_session(seed=11, env_id=4)
    assert server.gateway.sessions is not None and len(server.gateway.sessions) == 1  # the sessions given are used
    client = _client(server, session)
    messages = [SYSTEM, {"role": "user", "content": "Go."}]
    for turn in range(2):
        answer = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"Turn {turn}."}]
    client.chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": "Summary: went."}])
    client.completions.create(model="m", prompt="Available actions: Up.", max_tokens=4)
    assert not recorder.path(session.id).exists()  # written when the session closes, not before
    assert _delete(server, session) == 200
    text = recorder.path(session.id).read_text()
    assert session.key not in text  # the key is never written
    log = read_session(recorder.path(session.id))
    assert log.header["session"] == session.id and (log.header["seed"], log.header["env_id"]) == (11, 4)
    assert log.header["calls"] == 4 and log.header["metrics"] == session.metrics()
    assert [r.to_dict() for r in log.records] == [r.to_dict() for r in session.records]
    assert [r.cause for r in log.records] == ["first", None, "history_truncated", "history_rewritten"]
    assert log.records[1].prompt_start > 0  # an appended call holds only what it adds
    for i in range(len(log.records)):
        assert prompt_ids(log.records, i) == prompt_ids(session.records, i)
    first = prompt_ids(log.records, 0)
    assert first == server.gateway.link.chat.full(messages[:2])
    assert prompt_ids(log.records, 1)[:len(first) + len(log.records[0].response_ids)] == \
        first + log.records[0].response_ids  # the ids sampled, never re-tokenized
    assert recorder.written == 1 and recorder.failed == 0


@pytest.mark.timeout(60)
def test_an_expired_session_is_written_too(recorded):
    server, recorder = recorded
    session = server.open_session()
    _client(server, session).chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": "x"}])
    deadline = time.monotonic() + 10
    while not server.gateway.sessions.expire() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = read_session(recorder.path(session.id))
    assert log.header["calls"] == 1 and log.records[0].response_ids == session.records[0].response_ids


@pytest.mark.timeout(60)
def test_a_file_that_cannot_be_written_is_counted_and_the_other_sessions_still_close(recorded):
    server, recorder = recorded
    first, second = server.open_session(), server.open_session()
    shutil.rmtree(recorder.directory)
    server.gateway.sessions.close(first.id)  # logged, not raised
    recorder.directory.mkdir()
    server.gateway.sessions.close(second.id)
    assert (recorder.failed, recorder.written) == (1, 1) and recorder.path(second.id).exists()


@pytest.mark.timeout(60)
def test_read_session_refuses_what_is_not_a_whole_session_file(tmp_path):
    path = tmp_path / "s.jsonl"
    cases = [
        ("", "empty"),
        ('{"kind": "ragen.rollout.dump"}\n', "line 1: not a gateway session's header"),
        ('{"kind": "ragen.gateway.session", "calls": 2}\n{"index": 0, "endpoint": "completions"}\n',
         "the header says 2 calls, the file holds 1"),
        ('{"kind": "ragen.gateway.session", "calls": 1}\n{"index": 0, "endpoint": "x", "colour": 1}\n',
         "line 2: not a call record"),
        ('{"kind": "ragen.gateway.session", "calls": 1}\n{"endpoint": "x"}\n', "line 2: not a call record"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_session(path)
    path.write_text(json.dumps({"kind": "ragen.gateway.session", "calls": 0}) + "\n")
    assert read_session(path).records == []
