"""The gateway (``ragen.gateway``) with the ``openai`` client: sessions, exact tokens, segments,
streaming, tools and every refusal with its status and the field it names."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request

import pytest

from ragen.gateway.gateway import Gateway, GatewaySettings
from ragen.gateway.link import ManagerLink
from ragen.gateway.record import prompt_ids
from ragen.gateway.server import GatewayServer
from ragen.llm.scripted import ScriptedEngine
from ragen.llm.tool_calls import call_text
from ragen.llm.types import SamplingParams
from ragen.serving.server import SharedLLMInferenceManager

openai = pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are a helper. Available actions: Up, Down, Left, Right."}


def tool_answer(prompt: str, rng) -> tuple[str, float] | None:
    """The scripted policy of these tests: with the weather tool listed and no result yet, a call
    of it; with the result, a plain answer; otherwise the scripted engine's own answer."""
    if "weather_result" in prompt:
        return "It is sunny in Paris.", -1.0
    if "get_weather" in prompt:
        return call_text("get_weather", {"city": "Paris"}), -0.5
    return None


@contextlib.contextmanager
def serve(engine=None, sampling=SamplingParams(max_tokens=256), **settings):
    """A gateway over a manager of ``engine`` (the tests' tool policy by default), both closed after."""
    engine = engine or ScriptedEngine(answers="tests.test_gateway:tool_answer")
    manager = SharedLLMInferenceManager(engine)
    try:
        server = GatewayServer(Gateway(ManagerLink.of(manager, timeout_s=30), sampling, GatewaySettings(**settings)))
        try:
            yield server
        finally:
            server.close()
    finally:
        manager.close()


@pytest.fixture(scope="module")
def gateway():
    with serve() as server:
        yield server


def client_of(server, session):
    return openai.OpenAI(base_url=server.base_url(session), api_key=session.key, max_retries=0, timeout=30)


@pytest.mark.timeout(60)
def test_a_growing_chat_is_one_segment_whose_prompts_append_the_ids_sampled(gateway):
    session = gateway.open_session()
    client = client_of(gateway, session)
    messages = [SYSTEM, {"role": "user", "content": "Go."}]
    for turn in range(3):
        reply = client.chat.completions.create(model="any-name", messages=messages, logprobs=True)
        answer = reply.choices[0].message.content
        assert reply.usage.completion_tokens == len(reply.choices[0].logprobs.content) > 0
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"Turn {turn}."}]
    records = session.records
    assert [r.segment for r in records] == [0, 0, 0] and [r.cause for r in records] == ["first", None, None]
    chat = gateway.gateway.link.chat
    for i, r in enumerate(records):
        assert r.logprobs is not None and len(r.logprobs) == len(r.response_ids) > 0
        whole = prompt_ids(records, i)
        if i:  # the previous prompt, the ids sampled, then what the template adds: never re-tokenized
            before = prompt_ids(records, i - 1) + records[i - 1].response_ids
            assert whole[:len(before)] == before and r.prompt_start == len(before)
        else:
            assert whole == chat.full(messages[:2])
    assert session.metrics()["segments"] == 1 and session.metrics()["calls"] == 3


@pytest.mark.timeout(60)
def test_a_compacted_history_starts_a_new_segment_named_so(gateway):
    session = gateway.open_session()
    client = client_of(gateway, session)
    messages = [SYSTEM, {"role": "user", "content": "Go."}]
    answer = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
    long = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    client.chat.completions.create(model="m", messages=long)
    client.chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": "Summary: went."}])
    changed = [{"role": "system", "content": "Another system."}, {"role": "user", "content": "Go."}]
    client.chat.completions.create(model="m", messages=changed)
    client.chat.completions.create(model="m", messages=changed + [{"role": "assistant", "content": "not said"},
                                                                  {"role": "user", "content": "x"}])
    assert [r.cause for r in session.records] == ["first", None, "history_truncated", "system_changed",
                                                  "history_rewritten"]
    assert [r.segment for r in session.records] == [0, 0, 1, 2, 3]
    metrics = session.metrics()
    assert metrics["breaks/history_truncated"] == metrics["breaks/system_changed"] == 1
    assert metrics["segments"] == 4


@pytest.mark.timeout(60)
def test_tool_calls_are_parsed_and_a_tool_round_trip_extends_the_segment(gateway):
    session = gateway.open_session()
    client = client_of(gateway, session)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    choice = reply.choices[0]
    # the text before the call stays the content (the scripted policy thinks first), as vLLM's hermes parser does
    assert choice.finish_reason == "tool_calls" and choice.message.content.startswith("<think>")
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "weather_result: sunny"}]
    final = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert final.choices[0].message.content.endswith("<answer>It is sunny in Paris.</answer>")
    assert final.choices[0].finish_reason == "stop"
    assert [r.cause for r in session.records] == ["first", None]  # the tool call as sent back: one segment
    changed = client.chat.completions.create(model="m", messages=messages, tools=TOOLS[:1] + [
        {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {}}}}])
    assert changed.choices[0].message is not None and session.records[-1].cause == "tools_changed"


@pytest.mark.timeout(60)
def test_a_stream_ends_with_done_and_its_usage_and_matches_the_answer_whole(gateway):
    session = gateway.open_session(seed=7, env_id=3)
    client = client_of(gateway, session)
    messages = [SYSTEM, {"role": "user", "content": "Go."}]
    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the text as the engine samples it (the scripted engine tells its answer in parts), not whole at the end
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(session.records[0].response_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    again = gateway.open_session(seed=7, env_id=3)  # the same request key: the same sample
    whole = client_of(gateway, again).chat.completions.create(model="m", messages=messages)
    assert whole.choices[0].message.content == text


def _streamed_chat(client, messages, **kw):
    """A streamed chat call: its content chunks' texts, its tool calls (by index, the arguments
    joined) and its finish reason."""
    texts, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(model="m", messages=messages, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            texts.append(delta.content)
        for call in delta.tool_calls or ():
            name, args = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return texts, calls, finish


@pytest.mark.timeout(60)
def test_a_streamed_tool_call_never_shows_its_text_as_content(gateway):
    """With tools, the text from ``<tool_call>`` on is held back and the parsed calls come as
    ``tool_calls`` deltas at the end: the streamed content is the answer's content whole."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    texts, calls, finish = _streamed_chat(client_of(gateway, gateway.open_session(seed=2, env_id=5)), messages,
                                          tools=TOOLS)
    whole = client_of(gateway, gateway.open_session(seed=2, env_id=5)).chat.completions.create(
        model="m", messages=messages, tools=TOOLS).choices[0]
    assert finish == whole.finish_reason == "tool_calls" and len(texts) > 1
    assert "".join(texts) == whole.message.content and all("<tool_call>" not in t and "{" not in t for t in texts)
    (call,) = whole.message.tool_calls
    assert calls == {0: (call.function.name, call.function.arguments)}


@pytest.mark.timeout(60)
def test_a_streamed_completion_comes_in_parts_that_join_to_the_answer_whole(gateway):
    prompt = "Available actions: Up, Down."
    session = gateway.open_session(seed=3, env_id=1)
    chunks = list(client_of(gateway, session).completions.create(model="m", prompt=prompt, stream=True,
                                                                 stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    whole = client_of(gateway, gateway.open_session(seed=3, env_id=1)).completions.create(model="m", prompt=prompt)
    assert len(texts) > 1 and "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.timeout(120)
def test_a_stream_on_the_hf_engine_shows_the_content_of_the_same_call_whole(tiny_model_path):
    """The tiny model, token by token: the streamed text joins to the content of the same call
    unstreamed (the engine's text, special tokens left out)."""
    from ragen.llm import make_engine

    with serve(make_engine({"name": "hf", "device": "cpu"}, tiny_model_path),
               SamplingParams(max_tokens=24)) as server:
        messages = [{"role": "user", "content": "Available actions: Up, Down. Go."}]
        texts, _, finish = _streamed_chat(client_of(server, server.open_session(seed=1, env_id=1)), messages)
        whole = client_of(server, server.open_session(seed=1, env_id=1)).chat.completions.create(
            model="m", messages=messages).choices[0]
        assert len(texts) > 1 and "".join(texts) == whole.message.content and finish == whole.finish_reason


@pytest.mark.timeout(60)
def test_completions_take_text_or_token_ids_and_a_prompt_that_grows_extends_its_segment(gateway):
    session = gateway.open_session()
    client = client_of(gateway, session)
    first = client.completions.create(model="m", prompt="Available actions: Up, Down.", max_tokens=8, logprobs=0)
    assert first.choices[0].finish_reason == "length" and len(first.choices[0].logprobs.token_logprobs) == 8
    ids = prompt_ids(session.records, 0) + session.records[0].response_ids + [10, 65]
    client.completions.create(model="m", prompt=ids, max_tokens=4)
    assert [r.cause for r in session.records] == ["first", None] and prompt_ids(session.records, 1) == ids


@pytest.mark.timeout(60)
def test_the_rollouts_sampling_wins_and_what_it_overrode_is_recorded(gateway):
    session = gateway.open_session()
    client = client_of(gateway, session)
    reply = client.chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": "Go."}],
                                           temperature=0, seed=5, max_tokens=1000)
    assert session.records[0].overrides == {"temperature": 0.0, "seed": 5, "max_tokens": 1000}
    assert reply.usage.completion_tokens <= 256  # the rollout's cap
    cut = client.chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": "Go."}],
                                         max_tokens=3)
    assert cut.usage.completion_tokens == 3 and cut.choices[0].finish_reason == "length"


def _post(url: str, body: bytes, key: str | None, method: str = "POST") -> tuple[int, dict, dict]:
    request = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


@pytest.mark.timeout(60)
def test_every_refusal_has_its_status_and_names_what_is_at_fault(gateway):
    session, other = gateway.open_session(), gateway.open_session()
    url = gateway.base_url(session) + "/chat/completions"
    good = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    cases = [
        (good, None, 401, None), (good, other.key, 401, None),
        (b"{not json", session.key, 400, None),
        (json.dumps({"messages": "hi"}).encode(), session.key, 400, "messages"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), session.key, 400,
         "messages[0].role"),
        (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(), session.key,
         400, "messages[0].content[0]"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), session.key, 400, "n"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
         session.key, 400, "temperature"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}).encode(),
         session.key, 400, "tool_choice"),
    ]
    for body, key, status, param in cases:
        got, answer, _ = _post(url, body, key)
        assert got == status, (body, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["param"] == param
    unknown = url.replace(session.id, "0" * 16)
    assert _post(unknown, good, session.key)[0] == 404
    assert _post(f"http://{gateway.host}:{gateway.port}/sessions/{session.id}", b"", session.key, "DELETE")[0] == 200
    status, answer, _ = _post(url, good, session.key)
    assert status == 404 and "closed" in answer["error"]["message"]  # and never brought back
    metrics = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://{gateway.host}:{gateway.port}/metrics", headers={"Authorization": f"Bearer {gateway.key}"}),
        timeout=30).read())
    assert metrics["sessions_closed"] >= 1 and metrics["calls"] >= 1 and metrics["sessions_open"] >= 1
    assert _post(gateway.base_url(other) + "/chat/completions", good, other.key)[0] == 200


@pytest.mark.timeout(60)
def test_bounds_body_sessions_and_context():
    with serve(max_sessions=2, max_body_bytes=2000, max_context=300) as server:
        root = f"http://{server.host}:{server.port}/sessions"
        first = _post(root, b"{}", server.key)[1]
        assert _post(root, b"{}", "sk-wrong")[0] == 401
        _post(root, b"{}", server.key)
        status, answer, headers = _post(root, b"{}", server.key)
        assert status == 429 and headers.get("Retry-After") == "1" and "gateway.max_sessions" in answer["error"]["message"]
        url = first["base_url"] + "/chat/completions"
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 3000}]}).encode()
        status, answer, _ = _post(url, big, first["api_key"])
        assert status == 413 and "gateway.max_body_bytes" in answer["error"]["message"]
        long = json.dumps({"messages": [{"role": "user", "content": "y" * 400}]}).encode()
        status, answer, _ = _post(url, long, first["api_key"])
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded" and "300" in answer["error"]["message"]
        fits = json.dumps({"messages": [{"role": "user", "content": "y" * 250}]}).encode()
        status, answer, _ = _post(url, fits, first["api_key"])
        assert status == 200 and answer["usage"]["total_tokens"] <= 300  # max_tokens cut to the room left


class _FailingEngine(ScriptedEngine):
    def generate(self, requests, sampling):
        raise RuntimeError("the model fell over")


@pytest.mark.timeout(60)
def test_an_engine_failure_is_a_5xx_naming_it_and_the_session_records_it():
    with serve(engine=_FailingEngine()) as server:
        session = server.open_session()
        with pytest.raises(openai.InternalServerError) as caught:
            client_of(server, session).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert caught.value.status_code == 502 and "fell over" in caught.value.body["message"]
        assert "fell over" in session.records[0].error and session.metrics()["errors"] == 1


@pytest.mark.timeout(60)
def test_idle_sessions_expire_counted_and_refuse_later_calls():
    with serve(session_ttl_s=0.05) as server:
        session = server.open_session()
        import time
        time.sleep(0.1)
        assert server.gateway.sessions.expire() == 1 and server.gateway.sessions.expired == 1
        with pytest.raises(openai.NotFoundError):
            client_of(server, session).models.list()


@pytest.mark.timeout(120)
def test_malformed_requests_leave_the_server_serving(gateway):
    session = gateway.open_session()
    url = gateway.base_url(session) + "/chat/completions"
    for i in range(300):
        assert _post(url, b'{"messages": [' * (i % 7) + b"\xff", session.key)[0] == 400
    assert _post(url, b"[" * 100_000, session.key)[0] == 400  # nested past what json reads: not a 500
    reply = client_of(gateway, session).chat.completions.create(model="m", messages=[SYSTEM, {"role": "user",
                                                                                          "content": "Go."}])
    assert reply.choices[0].message.content


@pytest.mark.timeout(60)
def test_prompt_ids_given_cross_the_manager_as_sent_and_ids_past_the_vocabulary_are_refused():
    from ragen.llm.types import EngineError, GenerationRequest

    manager = SharedLLMInferenceManager(ScriptedEngine())
    try:
        client = manager.client(timeout_s=30)
        ids = list("<|user|>\nAvailable actions: Up, Down.\n<|assistant|>\n".encode())
        request = GenerationRequest(messages=[{"role": "user", "content": "Available actions: Up, Down."}],
                                    prompt_token_ids=ids)
        ticket = client.submit([request], SamplingParams(max_tokens=32))
        got_ticket, (completion,) = client.wait_any(30)
        assert got_ticket == ticket and completion.prompt_start == len(ids) and completion.prompt_token_ids == []
        bad = GenerationRequest(messages=[{"role": "user", "content": "x"}], prompt_token_ids=[1, 300])
        client.submit([bad], SamplingParams(max_tokens=4))
        with pytest.raises(EngineError, match=r"prompt_token_ids"):
            client.wait_any(30)
    finally:
        manager.close()


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                    "parameters": TOOLS[0]["function"]["parameters"]}]


@pytest.mark.timeout(60)
def test_the_responses_api_answers_calls_and_streams_and_a_round_trip_extends_the_segment(gateway):
    session = gateway.open_session()
    client = client_of(gateway, session)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model="m", input=question, instructions="Be brief.", tools=RESPONSES_TOOLS)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    items = question + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "weather_result: sunny"}]
    second = client.responses.create(model="m", input=items, instructions="Be brief.", tools=RESPONSES_TOOLS)
    assert second.output_text.endswith("It is sunny in Paris.</answer>") and second.status == "completed"
    assert second.usage.output_tokens == len(session.records[1].response_ids)
    assert [(r.endpoint, r.cause) for r in session.records] == [("responses", "first"), ("responses", None)]
    with client.responses.stream(model="m", input=items, instructions="Be brief.", tools=RESPONSES_TOOLS) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and streamed.output_text == second.output_text


@pytest.mark.timeout(60)
def test_a_streamed_response_sends_its_text_in_parts_and_its_calls_whole(gateway):
    """The Responses API's stream: the message's text in several deltas as the engine samples it,
    joining to the unstreamed response's text, never a tool call's; the calls as items at the end."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    for tools in (None, RESPONSES_TOOLS):
        kw = {"tools": tools} if tools else {}
        whole = client_of(gateway, gateway.open_session(seed=4, env_id=2)).responses.create(
            model="m", input=question, **kw)
        with client_of(gateway, gateway.open_session(seed=4, env_id=2)).responses.stream(
                model="m", input=question, **kw) as stream:
            events = list(stream)
            streamed = stream.get_final_response()
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) > 1 and "".join(deltas) == whole.output_text == streamed.output_text
        assert all("<tool_call>" not in d for d in deltas)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [i.type for i in streamed.output] == [i.type for i in whole.output] == \
            ["message"] + ["function_call"] * bool(tools)


@pytest.mark.timeout(60)
def test_the_responses_api_refuses_what_it_does_not_serve_naming_the_field(gateway):
    session = gateway.open_session()
    url = gateway.base_url(session) + "/responses"
    for body, param in [({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
                        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
                        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
                        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens")]:
        status, answer, _ = _post(url, json.dumps(body).encode(), session.key)
        assert status == 400 and answer["error"]["param"] == param, answer


def _gateway_in_a_worker(client, opened, stop) -> None:
    """A rollout worker's gateway: in its own process, over its own connection to the driver's manager."""
    from ragen.llm.scripted import byte_chat

    link = ManagerLink(client, byte_chat(), served_name="scripted", timeout_s=30)
    server = GatewayServer(Gateway(link, SamplingParams(max_tokens=256)))
    session = server.open_session()
    opened.put((server.base_url(session), session.key))
    stop.wait(60)
    opened.put([(r.cause, prompt_ids(session.records, i), r.response_ids) for i, r in enumerate(session.records)])
    server.close()


@pytest.mark.timeout(120)
def test_a_gateway_in_another_process_reaches_the_drivers_engine_with_exact_tokens():
    import multiprocessing

    manager = SharedLLMInferenceManager(ScriptedEngine())
    ctx = multiprocessing.get_context("spawn")
    opened, stop = ctx.Queue(), ctx.Event()
    worker = ctx.Process(target=_gateway_in_a_worker, args=(manager.client(30), opened, stop))
    worker.start()
    try:
        base_url, key = opened.get(timeout=60)
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)
        messages = [SYSTEM, {"role": "user", "content": "Go."}]
        answer = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        client.chat.completions.create(model="m", messages=messages + [{"role": "assistant", "content": answer},
                                                                       {"role": "user", "content": "Again."}])
        stop.set()
        (cause0, ids0, sampled0), (cause1, ids1, _) = opened.get(timeout=60)
        assert (cause0, cause1) == ("first", None) and ids1[:len(ids0) + len(sampled0)] == ids0 + sampled0
        assert manager.stats.requests == 2  # both calls went through the driver's manager
    finally:
        stop.set()
        worker.join(30)
        manager.close()


@pytest.mark.timeout(60)
def test_an_engine_that_reports_no_prompt_ids_is_unaudited_not_drift():
    with serve(engine=ScriptedEngine(return_prompt_ids=False)) as server:
        session = server.open_session()
        client_of(server, session).chat.completions.create(model="m", messages=[SYSTEM, {"role": "user",
                                                                                      "content": "Go."}])
        assert session.metrics().get("unaudited") == 1 and "drift" not in session.metrics()
        assert prompt_ids(session.records, 0)  # the record keeps the ids sent


def long_answer(prompt: str, rng) -> tuple[str, float] | None:
    """An answer of 4 MB where the prompt asks for one (past any socket's buffers), else the script's."""
    return ("word " * 800_000, -1.0) if "LONG" in prompt else None


@pytest.mark.timeout(120)
def test_a_client_that_stops_reading_its_stream_delays_only_itself():
    import socket
    import time

    with serve(engine=ScriptedEngine(answers="tests.test_gateway:long_answer"),
               sampling=SamplingParams(max_tokens=5_000_000), io_timeout_s=2.0) as server:
        stalled, other = server.open_session(), server.open_session()
        body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "LONG"}]}).encode()
        sock = socket.create_connection((server.host, server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(f"POST /sessions/{stalled.id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     f"Authorization: Bearer {stalled.key}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # and never reads
        deadline = time.monotonic() + 30
        while not stalled.records and time.monotonic() < deadline:
            time.sleep(0.02)
        reply = client_of(server, other).chat.completions.create(model="m", messages=[SYSTEM, {"role": "user",
                                                                                              "content": "Go."}])
        assert reply.choices[0].message.content and stalled.in_flight == 1  # served while the other is stuck
        while stalled.in_flight and time.monotonic() < deadline:  # dropped past io_timeout_s
            time.sleep(0.05)
        assert stalled.in_flight == 0 and stalled.records[0].total_s > 0
        sock.close()
