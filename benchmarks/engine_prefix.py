"""Engine time of three rollouts on the default model, with and without prefix sharing.

    python benchmarks/engine_prefix.py [--rollouts bandit_train,bandit_val,sokoban_5turn]
                                       [--settings off,calls,turns] [--json OUT]

The rollouts (sequential, the hf engine on the embedded SmolLM2-135M, seed 0):

- ``bandit_train``: the default training rollout (4 groups x 8, one 10-token answer);
- ``bandit_val``: the default validation rollout (``config/base.yaml``, group_size 1);
- ``sokoban_5turn``: SimpleSokoban, 4 groups x 4, five turns with ``enable_think``,
  48-token answers.

Each runs under three settings, side by side in one process: ``off``
(``engine.prefix_cache=false``: every prompt computed in full), ``calls``
(prompts shared within a call only: ``engine.turn_cache_mb=0``) and ``turns``
(the default: also each episode's cache kept for its next turn). For each: engine time, prompt tokens
computed and reused, answer tokens, how many episodes are the same as under the first setting
(``rollout_digest``), and the floor: the forward-pass FLOPs of the tokens the
engine computed (prompt tokens prefilled, and one decode step per row and step,
as the decode loop runs every row until the last stops), divided by this
machine's measured matmul throughput (float32, the torch threads in use).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ragen.config_files import config_dir
from ragen.llm import make_engine
from ragen.llm.default_model import resolve_model_path
from ragen.llm_agent import AgentSetup, LLMAgentProxy
from ragen.rollout.types import rollout_digest

SOKOBAN = ["agent_proxy.max_turn=5", "agent_proxy.enable_think=true", "es_manager.train.env_groups=4",
           "es_manager.train.group_size=4", "es_manager.train.env_configs.tags=[SimpleSokoban]",
           "es_manager.train.env_configs.n_groups=[4]", "ctx_manager.generation.response_length=48",
           "custom_envs.SimpleSokoban.max_tokens=48"]
ROLLOUTS = {"bandit_train": ([], "train"), "bandit_val": ([], "val"), "sokoban_5turn": (SOKOBAN, "train")}
SETTINGS = {"off": ["engine.prefix_cache=false"], "calls": ["engine.prefix_cache=true", "engine.turn_cache_mb=0"],
            "turns": ["engine.prefix_cache=true"]}


def matmul_gflops(hidden: int, intermediate: int) -> float:
    """float32 throughput of the model's own matmul shapes (rows of 512 tokens)."""
    a, b = torch.randn(512, hidden), torch.randn(hidden, intermediate)
    for _ in range(3):
        a @ b
    n, t = 40, time.perf_counter()
    for _ in range(n):
        a @ b
    return 2 * 512 * hidden * intermediate * n / (time.perf_counter() - t) / 1e9


def flops_per_token(model, context: int, with_head: bool) -> float:
    """Forward FLOPs of one token: 2 x the non-embedding weights, attention over ``context``
    keys, and the vocabulary projection when this position's logits are computed."""
    cfg = model.config
    embed = cfg.vocab_size * cfg.hidden_size
    body = sum(p.numel() for p in model.parameters()) - embed * (1 if cfg.tie_word_embeddings else 2)
    attention = 4 * context * cfg.hidden_size * cfg.num_hidden_layers
    return 2 * body + attention + (2 * embed if with_head else 0)


def run(name: str, setting: str, model_path: str) -> dict:
    extra, split = ROLLOUTS[name]
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        cfg = compose("base", overrides=extra + SETTINGS[setting])
    engine = make_engine(OmegaConf.to_container(cfg.engine), model_path)
    setup = AgentSetup.from_config(OmegaConf.to_container(cfg, resolve=True))
    with LLMAgentProxy(setup, engine) as proxy:
        result = proxy.rollout(split, rollout_index=0)
    m = result.metrics
    prompts = [t for tr in result.trajectories for t in tr.turns]
    prefilled = m.get("engine/prefill_tokens", 0.0)
    # one decode step per row per step until the slowest row of its call stops: the calls
    # are the turns here (sequential rollout: one call per turn over the active envs)
    decode_rows = 0
    turns = max(len(tr.turns) for tr in result.trajectories)
    for turn in range(turns):
        rows = [tr.turns[turn] for tr in result.trajectories if len(tr.turns) > turn]
        longest = max(len(engine.tokenizer(t.response, add_special_tokens=False)["input_ids"]) + 1 for t in rows)
        decode_rows += len(rows) * min(longest, setup.loop.sampling.max_tokens)
    context = int(prefilled / max(1, len(prompts)))
    flops = (prefilled * flops_per_token(engine.model, context // 2, with_head=False)
             + decode_rows * flops_per_token(engine.model, context, with_head=True))
    out = {"rollout": name, "setting": setting, "engine_s": m["timing/engine_s"],
           "calls": int(m["engine/calls"]), "requests": len(prompts), "prompt_tokens_computed": int(prefilled),
           "prompt_tokens_reused": int(m.get("engine/reused_tokens", 0.0)), "decode_token_steps": decode_rows,
           "tflop": flops / 1e12, "digest": rollout_digest(result.trajectories),
           "episode_digests": [rollout_digest([t]) for t in result.trajectories],
           "success": m.get("rollout/success")}
    cfg_model = engine.model.config
    out["floor_s"] = flops / 1e9 / matmul_gflops(cfg_model.hidden_size, cfg_model.intermediate_size)
    out["turn_cache_mb"] = m.get("engine/turn_cache_mb", 0.0)  # at the rollout's end (then freed)
    out["turn_cache_evicted"] = int(m.get("engine/turn_cache_evicted", 0))
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", default=",".join(ROLLOUTS), help="comma-separated, from " + ", ".join(ROLLOUTS))
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, from " + ", ".join(SETTINGS))
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    names = [n for n in args.rollouts.split(",") if n]
    settings = [n for n in args.settings.split(",") if n]
    bad = [n for n in names if n not in ROLLOUTS]
    if bad:
        parser.error(f"--rollouts: unknown {bad}; choose from {list(ROLLOUTS)}")
    bad = [n for n in settings if n not in SETTINGS]
    if bad:
        parser.error(f"--settings: unknown {bad}; choose from {list(SETTINGS)}")
    model_path = resolve_model_path("default")
    print(f"torch threads {torch.get_num_threads()}, cores {os.cpu_count()}")
    rows = []
    for name in names:
        runs = [run(name, setting, model_path) for setting in settings]
        rows += runs
        for r in runs:
            print(f"{name:14} {r['setting']:5} engine {r['engine_s']:7.2f} s | "
                  f"prompt tokens computed {r['prompt_tokens_computed']:6d} reused {r['prompt_tokens_reused']:6d} | "
                  f"decode steps {r['decode_token_steps']:5d} | {r['tflop']:.2f} TFLOP, floor {r['floor_s']:6.2f} s "
                  f"({r['floor_s'] / r['engine_s']:.0%} of it) | turn cache {r['turn_cache_mb']:.0f} MiB, "
                  f"{r['turn_cache_evicted']} evicted")
        first = runs[0]
        for r in runs[1:]:
            same = sum(a == b for a, b in zip(first["episode_digests"], r["episode_digests"]))
            print(f"{name:14} {r['setting']} vs {first['setting']}: {first['engine_s'] / r['engine_s']:.1f}x, "
                  f"same trajectories: {same} of {len(r['episode_digests'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
