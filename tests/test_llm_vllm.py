"""VLLMEngine: the adapter's mapping to vLLM's API (checked against a stand-in
``vllm`` module, so it runs everywhere), the missing-vllm error, and a real
vLLM run that is skipped unless vllm and a GPU are present."""

from __future__ import annotations

import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from ragen.llm import make_engine
from ragen.llm.types import GenerationRequest, SamplingParams, request_seed


def _vllm_usable() -> bool:
    if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
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


class FakeLLM:
    def __init__(self, model, **kwargs):
        from transformers import AutoTokenizer

        self.model_path, self.kwargs = model, kwargs
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
            sample = SimpleNamespace(text=f"s{p.seed}", token_ids=(p.seed % 97, 5),
                                     finish_reason="length" if p.max_tokens <= 2 else "stop")
            outputs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[sample]))
        return outputs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.prefix_resets += 1


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__version__ = "0.0-fake"
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def test_generate_maps_requests_to_vllm(fake_vllm, tiny_model_path):
    engine = make_engine({"name": "vllm", "gpu_memory_utilization": 0.3, "max_model_len": 1024}, tiny_model_path)
    assert engine.llm.model_path == tiny_model_path
    assert engine.llm.kwargs == {"dtype": "auto", "gpu_memory_utilization": 0.3, "enforce_eager": False,
                                 "max_model_len": 1024, "tensor_parallel_size": 1}
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_tokens=32, seed=4, stop=["</answer>"])
    reqs = [req("a", env_id=1, seed=3), req("b", env_id=2, max_tokens=2), req("c", env_id=3, max_tokens=0)]
    completions = engine.generate(reqs, sampling)
    prompts, params = engine.llm.generate_calls[-1]
    assert len(prompts) == 2  # max_tokens=0 is answered without vLLM
    assert prompts[0]["prompt_token_ids"] == engine.encode_prompt(reqs[0].messages)
    eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r, p in zip(reqs, params):
        assert p.seed == request_seed(4, r.key) and p.n == 1
        assert (p.temperature, p.top_p, p.top_k, p.stop) == (0.7, 0.9, -1, ["</answer>"])
        assert eos in p.stop_token_ids
    assert [p.max_tokens for p in params] == [32, 2]
    assert [c.finish_reason for c in completions] == ["stop", "length", "length"]
    assert completions[0].text == f"s{request_seed(4, reqs[0].key)}"
    assert completions[0].response_token_ids == [request_seed(4, reqs[0].key) % 97, 5]
    assert completions[0].prompt_token_ids == prompts[0]["prompt_token_ids"]
    assert completions[2].response_token_ids == [] and completions[2].prompt_token_ids
    assert [c.env_id for c in completions] == [1, 2, 3]


def test_load_weights_through_collective_rpc(fake_vllm, tiny_model_path):
    engine = make_engine({"name": "vllm"}, tiny_model_path)
    weights = {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3), "lm_head.weight": torch.ones(2, 2)}
    assert engine.load_weights(weights) == 1
    assert engine.llm.worker.model_runner.model.loaded == list(weights)
    assert engine.llm.prefix_resets == 1
    assert engine.generate([req("x")], SamplingParams())[0].policy_version == 1


def test_load_weights_in_process_driver_worker(fake_vllm, tiny_model_path):
    engine = make_engine({"name": "vllm"}, tiny_model_path)
    model = FakeModel()
    driver = SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)))
    engine.llm.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=driver))
    engine.llm.collective_rpc = None  # must not be needed on this route
    assert engine.load_weights([("a.weight", torch.zeros(1))]) == 1
    assert model.loaded == ["a.weight"]


def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    with pytest.raises(ImportError, match=r"pip install vllm"):
        make_engine({"name": "vllm"}, None)


@pytest.mark.skipif(not _vllm_usable(), reason="needs an importable vllm and a CUDA GPU")
def test_real_vllm_generation_and_weight_update():
    from transformers import AutoModelForCausalLM

    from ragen.llm.default_model import resolve_model_path

    engine = make_engine({"name": "vllm", "gpu_memory_utilization": 0.3, "enforce_eager": True,
                          "max_model_len": 1024}, "default")
    try:
        sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=1)
        reqs = [req(f"Say something about the number {i}.", env_id=i) for i in range(4)]
        batched = engine.generate(reqs, sampling)
        alone = [engine.generate([r], sampling)[0] for r in reqs]
        assert all(c.text and c.response_token_ids for c in batched)
        assert [c.response_token_ids for c in batched] == [c.response_token_ids for c in alone]
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        before = engine.generate(reqs, greedy)
        hf = AutoModelForCausalLM.from_pretrained(resolve_model_path("default"))
        scrambled = [(n, torch.randn_like(p)) for n, p in hf.named_parameters() if "layers.0.mlp" in n]
        assert engine.load_weights(scrambled) == 1
        after = engine.generate(reqs, greedy)
        assert {c.policy_version for c in after} == {1}
        assert [c.response_token_ids for c in after] != [c.response_token_ids for c in before]
    finally:
        engine.close()
