"""verl's agent loop on a costly env: env resets and steps inline on the event loop
against on env processes (``ragen.verl.env_side.EnvSide``).

    python benchmarks/verl_env_side.py [--episodes 32] [--workers 2] [--latency-s 0.05] [--rounds 3]

``--episodes`` episodes of the ``env_bound_heavy`` preset's HeavySokoban (12x12
rooms, 4 boxes: tens of ms of CPU a reset) play at once on one asyncio loop,
as verl's ``AgentLoopWorker`` runs its samples, through ``play_tokens``. The
server answers each request after ``--latency-s`` (a GPU server's time for an
answer) with the same valid answer's tokens, so the env side is what differs.
Rounds alternate inline and processes on the same seeds, new ones each round
(a process keeps the rooms it generated: seeds seen before would cost nothing);
both must give the same trajectories.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import replace

from ragen.llm.chat_tokens import ChatTokens
from ragen.rollout.types import StopReason, rollout_digest
from ragen.config_files import compose
from ragen.verl.env_side import EnvSide
from ragen.verl.episode_tokens import play_tokens
from ragen.verl.setup import VerlEnvs


def run(envs: VerlEnvs, tokenizer, episodes: int, workers: int, latency_s: float, first_seed: int) -> tuple[float, str]:
    chat = ChatTokens.of(tokenizer)
    answer = tokenizer("Up || Left || Down</answer>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    async def generate(prompt_ids, max_tokens):
        await asyncio.sleep(latency_s)
        return answer[:max_tokens], [-0.1] * min(len(answer), max_tokens)

    specs = []
    for i in range(episodes):
        spec, config = envs.spec({"tag": "HeavySokoban", "seed": first_seed + i})
        specs.append(replace(spec, env_id=i, group_id=i))
    side = EnvSide(workers)

    async def all_of():
        return await asyncio.gather(*[
            play_tokens(s, config, side, chat, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), generate,
                        response_length=1 << 16, prompt_length=1 << 16) for s in specs])

    try:
        if workers:  # the processes start before the clock: verl's worker keeps them for the whole run
            asyncio.run(_warm(side, envs, config))
        t0 = time.perf_counter()
        records = asyncio.run(all_of())
        wall = time.perf_counter() - t0
    finally:
        side.close()
    return wall, rollout_digest([r.trajectory for r in records])


async def _warm(side: EnvSide, envs: VerlEnvs, config) -> None:
    spec, _ = envs.spec({"tag": "Bandit", "seed": 0})
    keys = [side.new_key() for _ in range(side.workers)]
    steps = await asyncio.gather(*[side.start(k, replace(spec, env_id=-1 - i), config) for i, k in enumerate(keys)])
    for key, step in zip(keys, steps):
        if step.request is not None:
            await side.end(key, StopReason.MAX_TURNS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--latency-s", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from ragen.llm.default_model import resolve_model_path

    cfg = compose("base", ["benchmark=env_bound_heavy", "agent_proxy.max_turn=5"])
    envs = VerlEnvs(cfg, "base + env_bound_heavy")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    times = {"inline": [], "processes": []}
    for r in range(args.rounds):
        digests = set()
        for mode, workers in (("inline", 0), ("processes", args.workers)):
            wall, digest = run(envs, tokenizer, args.episodes, workers, args.latency_s, 1000 + r * args.episodes)
            times[mode].append(wall)
            digests.add(digest)
            print(f"round {r} {mode:9s} {wall:6.2f} s", flush=True)
        assert len(digests) == 1, "inline and processes played different trajectories"
    inline, procs = statistics.median(times["inline"]), statistics.median(times["processes"])
    print(json.dumps({"episodes": args.episodes, "workers": args.workers, "latency_s": args.latency_s,
                      "inline_s": times["inline"], "processes_s": times["processes"],
                      "speedup_median": round(inline / procs, 2)}))


if __name__ == "__main__":
    main()
