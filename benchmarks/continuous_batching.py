"""transformers' continuous-batching manager against HFEngine, on the same prompts.

    python benchmarks/continuous_batching.py

Records the calls of the five-turn SimpleSokoban rollout of ``engine_prefix.py``
(16 requests a call, 48-token answers), then times the same calls, in order, on
a fresh ``HFEngine`` (prefix sharing and turn cache on) and on
``model.generate_batch`` (``ContinuousBatchingManager``: paged attention,
``allow_block_sharing=True``, one persistent manager for all calls), both sampling.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from engine_prefix import SOKOBAN, SETTINGS
from ragen.config_files import config_dir
from ragen.llm import make_engine
from ragen.llm.default_model import resolve_model_path
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

path = resolve_model_path("default")
with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
    cfg = compose("base", overrides=SOKOBAN + SETTINGS["turns"])
engine = make_engine(OmegaConf.to_container(cfg.engine), path)
calls = []
orig = engine.generate


def rec(reqs, sampling):
    calls.append((list(reqs), sampling))
    return orig(reqs, sampling)


engine.generate = rec
setup = AgentSetup.from_config(OmegaConf.to_container(cfg, resolve=True))
with LLMAgentProxy(setup, engine) as proxy:
    proxy.rollout("train", rollout_index=0)
engine.generate = orig
print("calls", [len(r) for r, _ in calls])
fresh = make_engine(OmegaConf.to_container(cfg.engine), path)
t = time.perf_counter()
for reqs, sampling in calls:
    fresh.generate(reqs, sampling)
hf_s = time.perf_counter() - t
print(f"HFEngine: {hf_s:.1f} s, prompt tokens computed {fresh.stats().tokens_prefilled} reused {fresh.stats().tokens_reused}")
model = fresh.model
prompts = [[fresh.encode_prompt(r.messages) for r in reqs] for reqs, _ in calls]
gc = GenerationConfig(max_new_tokens=48, do_sample=True, temperature=1.0, top_p=1.0,
                      eos_token_id=sorted(fresh.stop_token_ids), pad_token_id=fresh.pad_token_id)
cb = ContinuousBatchingConfig(allow_block_sharing=True)
t = time.perf_counter()
for i, ps in enumerate(prompts):
    c0 = time.perf_counter()
    out = model.generate_batch(ps, generation_config=gc, continuous_batching_config=cb, persistent_manager=True,
                               warmup=False)
    print(f"  continuous batching, call {i}: {time.perf_counter() - c0:.1f} s, {len(out)} answers")
print(f"ContinuousBatchingManager: {time.perf_counter() - t:.1f} s")
