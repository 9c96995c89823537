"""Lockstep against env-level turns in the turn loop, on the scripted engine that batches continuously.

    python benchmarks/env_level_loop.py [--groups 64] [--group-size 4] [--turns 5] [--repeats 2]
        [--step-s 0.015] [--step-per-request-s 0.00005] [--tokens-median 100] [--tokens-sigma 1.0]
        [--time-scale 0.1]

The same specs (SimpleSokoban and FrozenLake, half each) played by ``run_envs``
in the calling process, alternating: lockstep (one stream: every turn waits for
the longest answer of all envs) and env-level (``batching=EnvLevel()``: every env
takes its next turn as soon as its own answer is in). Reports wall time, the
engine's decode steps and mean running requests (occupancy), the requests sent
separately (submits), and whether both gave the same trajectories.
"""

from __future__ import annotations

import argparse
import statistics
import time

from omegaconf import OmegaConf

from ragen.config_files import config_dir
from ragen.llm import make_engine
from ragen.llm.types import SamplingParams
from ragen.rollout.context import ContextConfig
from ragen.rollout.envs import EnvSpecMaker
from ragen.rollout.batching import EnvLevel, Lockstep
from ragen.rollout.scheduler import KeptEnvs, LoopConfig, run_envs
from ragen.serving import direct_client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.015)
    parser.add_argument("--step-per-request-s", type=float, default=0.00005)
    parser.add_argument("--tokens-median", type=float, default=100)
    parser.add_argument("--tokens-sigma", type=float, default=1.0)
    parser.add_argument("--tokens-max", type=int, default=2048)
    parser.add_argument("--time-scale", type=float, default=0.1)
    args = parser.parse_args()
    envs = OmegaConf.to_container(OmegaConf.load(config_dir() / "envs.yaml"), resolve=True)["custom_envs"]
    half = args.groups // 2
    specs = EnvSpecMaker("train", {"env_groups": args.groups, "group_size": args.group_size,
                                   "env_configs": {"tags": ["SimpleSokoban", "FrozenLake"],
                                                   "n_groups": [half, args.groups - half]}}, envs, 0).make_specs()
    loop = LoopConfig(context=ContextConfig(max_actions_per_turn=3), sampling=SamplingParams(max_tokens=64),
                      max_turn=args.turns)
    engine = make_engine({"name": "scripted", "continuous_batching": {
        "step_s": args.step_s, "step_per_request_s": args.step_per_request_s, "tokens_median": args.tokens_median,
        "tokens_sigma": args.tokens_sigma, "tokens_max": args.tokens_max, "time_scale": args.time_scale}})
    rows: dict[bool, list] = {False: [], True: []}
    trajectories = {}
    try:
        for _ in range(args.repeats):
            for env_level in (False, True):
                t0, steps, running = time.perf_counter(), engine.steps, engine.running_sum
                got, stats = run_envs(specs, direct_client(engine), loop, kept_envs=KeptEnvs(),
                                      batching=EnvLevel() if env_level else Lockstep())
                wall = time.perf_counter() - t0
                steps, running = engine.steps - steps, engine.running_sum - running
                rows[env_level].append((wall, steps, running / steps, stats.submits))
                trajectories.setdefault(env_level, got)
    finally:
        engine.close()
    print(f"{len(specs)} envs, {args.turns} turns, answers lognormal(median {args.tokens_median:g}, "
          f"sigma {args.tokens_sigma:g}, max {args.tokens_max}), steps {args.step_s:g} s + "
          f"{args.step_per_request_s:g} s a request, time scale {args.time_scale:g}")
    for env_level, name in ((False, "lockstep"), (True, "env-level")):
        walls = [r[0] for r in rows[env_level]]
        _, steps, occupancy, submits = rows[env_level][-1]
        print(f"{name:10s} wall {statistics.median(walls):.2f} s ({', '.join(f'{w:.2f}' for w in walls)}) | "
              f"decode steps {steps} | mean running requests {occupancy:.1f} | submits {submits}")
    ratios = [a[0] / b[0] for a, b in zip(rows[False], rows[True])]
    print(f"env-level against lockstep: {statistics.median(ratios):.2f}x | same trajectories: "
          f"{trajectories[False] == trajectories[True]}")


if __name__ == "__main__":
    main()
