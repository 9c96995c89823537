"""Step time of synchronous, generate-ahead and fully-async training.

    python benchmarks/async_training.py [--steps 8] [--train-s 0.3]

The rollout uses the scripted engine's GPU-like latency (a sleep per engine
call) on a mix of one-turn (Bandit) and five-turn (SimpleSokoban) groups, so
some groups straggle; the training step is a sleep of ``--train-s`` seconds
(a GPU-bound update holds no CPU either). For each mode it reports the mean
step time after the first step, the time the trainer waited for data, the
staleness of what it trained on, and the ideal ``max(rollout, train)``; for
the fully-async modes, partial rollouts against restarts: groups restarted and
dropped per step, and the response tokens generated and thrown away.
"""

from __future__ import annotations

import argparse
import statistics
import time

from ragen.env import to_plain
from ragen.llm.scripted import ScriptedEngine
from ragen.llm_agent import AgentSetup, LLMAgentProxy

def modes(k: int) -> dict[str, dict]:
    """The modes compared; ``k`` is the asynchronous ones' async_generation_ratio (the staleness bound)."""
    return {
        "sync (k=0)": {"async_generation_ratio": 0},
        f"generate-ahead (k={k})": {"async_generation_ratio": k},
        f"fully_async (k={k}), partial rollouts": {"rollout_mode": "fully_async", "async_generation_ratio": k,
                                                   "max_inflight_groups": 8, "partial_rollout": True},
        f"fully_async (k={k}), restarts": {"rollout_mode": "fully_async", "async_generation_ratio": k,
                                           "max_inflight_groups": 8, "partial_rollout": False},
    }


def setup(custom_envs: dict, mode: dict) -> AgentSetup:
    return AgentSetup.from_config({
        "custom_envs": custom_envs,
        "seed": {"train": 1, "val": 2},
        "agent_proxy": {"max_turn": 5, "use_parallel_rollout": True, "parallel_n_jobs": 2, "pipeline_depth": 1, **mode},
        "es_manager": {
            "train": {"env_groups": 8, "group_size": 4,
                      "env_configs": {"tags": ["BanditHinted", "SimpleSokoban"], "n_groups": [4, 4]}},
            "val": {"env_groups": 1, "group_size": 1, "env_configs": {"tags": ["BanditHinted"], "n_groups": [1]}},
        },
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--train-s", type=float, default=0.3)
    ap.add_argument("--engine-base-s", type=float, default=0.05)
    ap.add_argument("--k", type=int, default=1, help="async_generation_ratio of the asynchronous modes")
    args = ap.parse_args()
    from omegaconf import OmegaConf

    envs = to_plain(OmegaConf.load("config/envs.yaml"))["custom_envs"]
    rows = []
    for name, mode in modes(args.k).items():
        engine = ScriptedEngine(base_s=args.engine_base_s, per_token_s=2e-5, return_prompt_ids=False)
        with LLMAgentProxy(setup(envs, mode), engine) as proxy:
            proxy.rollout("val")  # start the workers
            steps, rollouts = [], []
            for step in range(args.steps):
                t0 = time.perf_counter()
                batch = proxy.next_train_batch(engine.policy_version)
                t1 = time.perf_counter()
                time.sleep(args.train_s)  # the training step
                with proxy.engine_lock:
                    engine.bump_policy_version()
                steps.append(time.perf_counter() - t0)
                rollouts.append(batch.metrics.get("timing/rollout_s", t1 - t0))
            m = proxy.async_metrics()
        sync_rollout = statistics.mean(rollouts[1:]) if name.startswith("sync") else None
        thrown = m.get("async/tokens_restarted", 0.0) + m.get("async/tokens_dropped", 0.0)
        rows.append((name, statistics.mean(steps[1:]), m.get("async/trainer_wait_s", float("nan")),
                     m.get("async/staleness_max", 0.0), m.get("async/dropped_stale", 0.0),
                     m.get("async/groups_restarted", 0.0), m.get("async/tokens_generated", float("nan")), thrown,
                     sync_rollout))
    rollout_s = rows[0][-1]
    print(f"train step {args.train_s:.2f} s, synchronous rollout {rollout_s:.2f} s: "
          f"sum {rollout_s + args.train_s:.2f} s, ideal max {max(rollout_s, args.train_s):.2f} s; "
          f"{args.steps} steps\n")
    print("| mode | mean step s | trainer waited s | max staleness | groups dropped / step | "
          "groups restarted / step | tokens generated | tokens thrown away |")
    print("|---|---|---|---|---|---|---|---|")
    for name, step_s, wait_s, stale, dropped, restarted, generated, thrown, _ in rows:
        share = f" ({thrown / generated:.0%})" if generated == generated and generated else ""
        print(f"| {name} | {step_s:.3f} | {wait_s:.2f} | {stale:.0f} | {dropped / args.steps:.2f} | "
              f"{restarted / args.steps:.2f} | {generated:.0f} | {thrown:.0f}{share} |")


if __name__ == "__main__":
    main()
