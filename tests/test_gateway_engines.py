"""The gateway (``ragen.gateway``) on each engine but the scripted one (``test_gateway.py``): the hf
engine on the tiny model, and the OpenAI engine in front of a fake OpenAI-compatible upstream that
takes token prompts (``test_llm_openai.FakeServer``). On each, a chat that only grows is one segment
whose recorded prompt ids are exactly those the engine sampled after, each equal to what the
rollout's ``token_history: append`` builds; and the drift audit counts an engine that samples after
other ids than those sent."""

from __future__ import annotations

import json

import pytest

from ragen.gateway.api_error import ApiError
from ragen.gateway.gateway import Gateway, GatewaySettings
from ragen.gateway.link import ManagerLink
from ragen.gateway.record import prompt_ids
from ragen.gateway.server import GatewayServer
from ragen.llm import make_engine
from ragen.llm.openai_engine import OpenAIEngine
from ragen.llm.scripted import ScriptedEngine
from ragen.llm.types import GenerationRequest, SamplingParams
from ragen.serving.server import SharedLLMInferenceManager

from tests.test_gateway import SYSTEM, _post, client_of
from tests.test_llm_openai import FakeServer, token_logprobs

openai = pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")


def served(engine, sampling=SamplingParams(max_tokens=12), **settings):
    """``engine`` behind a manager and a gateway server; close both with ``shut``."""
    manager = SharedLLMInferenceManager(engine)
    try:
        return manager, GatewayServer(Gateway(ManagerLink.of(manager, timeout_s=60), sampling,
                                              GatewaySettings(**settings)))
    except BaseException:
        manager.close()
        raise


def shut(manager, server) -> None:
    server.close()
    manager.close()


def spied(engine):
    """``engine`` whose ``generate`` keeps each request it answered with its completion."""
    seen: list = []
    generate = engine.generate

    def spy(requests, sampling):
        out = generate(requests, sampling)
        seen.extend(zip(requests, out))
        return out

    engine.generate = spy
    return seen


def grow_chat(client, turns: int = 3) -> list[list[dict]]:
    """A chat whose messages only grow, ``turns`` calls; the messages of each call."""
    messages, sent = [SYSTEM, {"role": "user", "content": "Go."}], []
    for turn in range(turns):
        sent.append(list(messages))
        reply = client.chat.completions.create(model="any-name", messages=messages, logprobs=True)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"Turn {turn}."}]
    return sent


def rollout_prompts(chat, sent, records) -> list[list[int]]:
    """Each call's prompt as the rollout builds it with ``ctx_manager.token_history: append``: the
    first rendered whole, each later one the previous prompt and the ids sampled, then the
    template's tokens of the new messages (``ChatTokens.request_ids``)."""
    prompts = []
    for i, messages in enumerate(sent):
        history = None if not i else prompts[-1] + records[i - 1].response_ids
        request = GenerationRequest(messages, history_token_ids=history,
                                    history_messages=len(sent[i - 1]) + 1 if i else 0)
        prompts.append(chat.request_ids(request)[0])
    return prompts


@pytest.fixture(scope="module")
def hf_gateway(tiny_model_path):
    engine = make_engine({"name": "hf", "device": "cpu"}, tiny_model_path)
    seen = spied(engine)
    manager, server = served(engine)
    yield server, engine, seen
    shut(manager, server)


@pytest.mark.timeout(120)
def test_on_hf_a_growing_chat_is_one_segment_of_the_ids_the_model_sampled_after(hf_gateway):
    server, engine, seen = hf_gateway
    seen.clear()
    session = server.open_session()
    client = client_of(server, session)
    reused = engine.stats().tokens_reused
    sent = grow_chat(client)
    assert engine.stats().tokens_reused > reused  # later calls computed only what their segment added
    records = session.records
    assert [r.segment for r in records] == [0, 0, 0] and [r.cause for r in records] == ["first", None, None]
    assert len(seen) == 3 and session.metrics().get("drift", 0) == 0
    for i, (record, (request, completion)) in enumerate(zip(records, seen)):
        whole = prompt_ids(records, i)
        # what the gateway sent, what HFEngine sampled after, and what the record keeps: one list
        assert request.prompt_token_ids == completion.prompt_token_ids == whole
        assert record.response_ids == completion.response_token_ids
        assert record.logprobs == completion.logprobs and len(record.logprobs) == len(record.response_ids) > 0
    assert [prompt_ids(records, i) for i in range(3)] == rollout_prompts(engine.chat, sent, records)
    assert engine.tokenizer.decode(prompt_ids(records, 0)) == engine.tokenizer.apply_chat_template(
        sent[0], tokenize=False, add_generation_prompt=True)


@pytest.mark.timeout(120)
def test_on_hf_token_texts_in_logprobs_are_the_tokenizers(hf_gateway):
    server, engine, _ = hf_gateway
    session = server.open_session()
    reply = client_of(server, session).chat.completions.create(
        model="m", messages=[SYSTEM, {"role": "user", "content": "Go."}], logprobs=True)
    content = reply.choices[0].logprobs.content
    (record,) = session.records
    assert [c.logprob for c in content] == pytest.approx(record.logprobs)
    assert [c.token for c in content] == [engine.tokenizer.decode([i]) for i in record.response_ids]
    text = client_of(server, session).completions.create(model="m", prompt="Available actions: Up.", logprobs=0)
    ids = session.records[1].response_ids
    assert text.choices[0].logprobs.tokens == [engine.tokenizer.decode([i]) for i in ids]


@pytest.mark.timeout(120)
def test_on_hf_the_models_context_bounds_a_prompt(hf_gateway):
    server, engine, _ = hf_gateway
    limit = engine.model.config.max_position_embeddings
    assert server.gateway.link.max_context == server.gateway.max_context == limit
    session = server.open_session()
    long = "Up Down Left Right " * limit
    assert len(engine.chat.full([{"role": "user", "content": long}])) > limit
    body = json.dumps({"messages": [{"role": "user", "content": long}]}).encode()
    status, answer, _ = _post(server.base_url(session) + "/chat/completions", body, session.key)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert str(limit) in answer["error"]["message"]


# -- the OpenAI engine in front of an upstream that takes token prompts -------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)


@pytest.fixture
def upstream(request, tiny_model_path, tiny_tokenizer):
    """A fake upstream (``FakeServer`` with ``request.param`` as its options), an OpenAI engine with
    the model's tokenizer in front of it, and a gateway in front of that."""
    fake = FakeServer(tokenizer=tiny_tokenizer, **getattr(request, "param", {}))
    engine = OpenAIEngine(fake.base_url, model="m", tokenizer=tiny_model_path)
    try:
        manager, server = served(engine, SamplingParams(max_tokens=64))
    except BaseException:
        engine.close()
        fake.stop()
        raise
    yield fake, engine, server
    shut(manager, server)
    engine.close()
    fake.stop()


@pytest.mark.timeout(120)
def test_over_an_openai_upstream_every_call_goes_as_the_ids_recorded(upstream, tiny_tokenizer):
    fake, engine, server = upstream
    session = server.open_session()
    sent = grow_chat(client_of(server, session))
    records = session.records
    assert [r.cause for r in records] == ["first", None, None] and session.metrics().get("drift", 0) == 0
    assert not fake.bodies and len(fake.token_bodies) == 3  # never as messages
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, (record, body) in enumerate(zip(records, fake.token_bodies)):
        assert body["prompt"] == prompt_ids(records, i) and body["return_token_ids"] is True
        assert record.response_ids[-1] == end and record.logprobs == token_logprobs(len(record.response_ids))
    assert [prompt_ids(records, i) for i in range(3)] == rollout_prompts(engine.chat, sent, records)
    assert engine.stats().token_prompt_fallbacks == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("upstream", [{"token_prompts": "refuse"}, {"token_prompts": "no_ids"}], indirect=True)
def test_an_upstream_that_refuses_token_prompts_is_a_502_never_a_chat_request(upstream):
    fake, engine, server = upstream
    session = server.open_session()
    with pytest.raises(openai.APIStatusError) as caught:
        client_of(server, session).chat.completions.create(model="m", messages=[SYSTEM, {"role": "user",
                                                                                         "content": "Go."}])
    assert caught.value.status_code == 502 and "token" in caught.value.body["message"]
    assert not fake.bodies and len(fake.token_bodies) == 1  # sent as ids once, never as messages
    assert "token" in session.records[0].error


@pytest.mark.timeout(120)
@pytest.mark.parametrize("upstream", [{"shifted_prompt_ids": True}], indirect=True)
def test_an_upstream_that_samples_after_other_ids_is_counted_as_drift(upstream):
    fake, engine, server = upstream
    session = server.open_session()
    client_of(server, session).chat.completions.create(model="m", messages=[SYSTEM, {"role": "user",
                                                                                     "content": "Go."}])
    assert session.metrics()["drift"] == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("upstream", [{"max_model_len": 300}], indirect=True)
def test_the_upstreams_context_bounds_a_prompt_before_it_is_sent(upstream):
    fake, engine, server = upstream
    assert server.gateway.link.max_context == 300
    session = server.open_session()
    body = json.dumps({"messages": [{"role": "user", "content": "Up Down " * 300}]}).encode()
    status, answer, _ = _post(server.base_url(session) + "/chat/completions", body, session.key)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded" and "300" in answer["error"]["message"]
    assert not fake.token_bodies and not fake.bodies


def test_the_gateway_refuses_an_openai_engine_without_a_tokenizer():
    engine = OpenAIEngine("http://127.0.0.1:9/v1", model="m")
    manager = SharedLLMInferenceManager(engine)
    try:
        with pytest.raises(ApiError, match="engine.tokenizer") as caught:
            ManagerLink.of(manager)
        assert "'openai'" in caught.value.message and "token" in caught.value.message
    finally:
        manager.close()
        engine.close()


# -- the drift audit ----------------------------------------------------------------------------


class _BOSEngine(ScriptedEngine):
    """Samples after the ids sent with one more in front (as a server that adds a BOS would)."""

    def prompt_ids(self, request):
        return [1] + super().prompt_ids(request)


@pytest.mark.timeout(60)
def test_an_engine_that_samples_after_other_ids_is_counted_as_drift():
    manager, server = served(_BOSEngine(), SamplingParams(max_tokens=16))
    try:
        session = server.open_session()
        client = client_of(server, session)
        for _ in range(2):
            client.chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": "Go."}])
        assert session.metrics()["drift"] == 2
    finally:
        shut(manager, server)


# -- opt-in: a real `vllm serve` of the default model (docs/vllm_cpu.md shows how to start one) -------
REAL_URL = __import__("os").environ.get("RAGEN_OPENAI_TEST_URL")


@pytest.mark.skipif(not REAL_URL, reason="set RAGEN_OPENAI_TEST_URL to a vllm server of the default model")
@pytest.mark.timeout(300)
def test_over_a_real_vllm_server_a_growing_chat_is_one_segment_of_the_ids_it_sampled_after():
    engine = OpenAIEngine(REAL_URL, tokenizer="default")
    manager, server = served(engine, SamplingParams(max_tokens=16, seed=3))
    try:
        assert server.gateway.link.max_context > 0  # vllm serve lists its max_model_len
        session = server.open_session()
        sent = grow_chat(client_of(server, session))
        records = session.records
        # the server reported the ids it sampled after: those sent (no drift), each the rollout's
        assert [r.cause for r in records] == ["first", None, None] and session.metrics().get("drift", 0) == 0
        assert [prompt_ids(records, i) for i in range(3)] == rollout_prompts(engine.chat, sent, records)
        assert all(len(r.logprobs) == len(r.response_ids) > 0 for r in records)
        assert engine.stats().token_prompt_fallbacks == 0
    finally:
        shut(manager, server)
        engine.close()
