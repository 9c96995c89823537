"""The tail cut: time to each full training batch with over-sampling, side by side.

    python benchmarks/tail_cut.py [--batches 5] [--over-sample 1.25] [--sequential] [hydra overrides]

Plays the ``long_tail`` preset (``test_parallel_rollout.py benchmark=long_tail``:
256 FrozenLake groups, long-tailed answers on an engine that batches
continuously) with env-level turns, on 2 loky workers (``--sequential``: in
the driver), in three settings: ``over_sample: 1.0`` (every group to its
end), ``over_sample: f, unfinished: carry`` and ``over_sample: f,
unfinished: abort``. Each setting has its own proxy and engine; they take
their training batches in turn (batch i of each, then batch i + 1), the
trainer's step being a policy version bump. Reports, per setting: the time to
each batch (mean, and the ratio of 1.0's mean to it), the groups started,
finished, carried, aborted and dropped as stale per batch, the mean turns of
an env in the batch and (so far) in the groups cut short, and the batch's
success rate: what ``abort``'s bias toward short episodes changes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragen.config_files import config_dir  # noqa: E402
from ragen.llm import make_engine  # noqa: E402
from ragen.llm_agent import AgentSetup, LLMAgentProxy  # noqa: E402


def compose(overrides: list[str]) -> dict:
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        cfg = hydra_compose(config_name="base-parallel", overrides=["benchmark=long_tail", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--over-sample", type=float, default=1.25)
    ap.add_argument("--sequential", action="store_true", help="the sequential backend (default: 2 loky workers)")
    args, overrides = ap.parse_known_args()
    plain = compose(overrides)
    plain["agent_proxy"].update(env_level_async=True, use_parallel_rollout=not args.sequential)
    settings = {"over_sample 1.0": {"over_sample": 1.0},
                f"over_sample {args.over_sample:g}, carry": {"over_sample": args.over_sample, "unfinished": "carry"},
                f"over_sample {args.over_sample:g}, abort": {"over_sample": args.over_sample, "unfinished": "abort"}}
    proxies, engines, walls, metrics = {}, {}, {}, {}
    try:
        for name, over in settings.items():
            cfg = {**plain, "agent_proxy": {**plain["agent_proxy"], **over}}
            engines[name] = make_engine(cfg["engine"], cfg.get("model_path"))
            proxies[name] = LLMAgentProxy(AgentSetup.from_config(cfg), engines[name])
            proxies[name].rollout("val")  # warm-up: the workers start
            walls[name], metrics[name] = [], []
        for i in range(args.batches):
            for name, proxy in proxies.items():
                t0 = time.perf_counter()
                batch = proxy.next_train_batch(engines[name].policy_version)
                walls[name].append(time.perf_counter() - t0)
                metrics[name].append(batch.metrics)
                with proxy.engine_lock:
                    engines[name].bump_policy_version()
                print(f"batch {i + 1} {name}: {walls[name][-1]:.2f} s", flush=True)
    finally:
        for name, proxy in proxies.items():
            proxy.close()
            engines[name].close()
    base = statistics.mean(walls["over_sample 1.0"])
    backend = "sequential" if args.sequential else "parallel, 2 loky workers"
    print(f"\nlong_tail, env-level turns, {backend}, {args.batches} batches each (per batch: mean)")
    print("| setting | time to a batch | vs 1.0 | started | finished | carried | aborted | stale | "
          "turns: batch / cut short | success |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in settings:
        ms = metrics[name]

        def mean(key: str) -> float:
            return statistics.mean(m.get(key, 0.0) for m in ms)

        wall = statistics.mean(walls[name])
        over = "oversample/groups_started" in ms[0]
        started = mean("oversample/groups_started" if over else "fill/groups_sampled")
        finished = mean("oversample/groups_finished" if over else "fill/groups_sampled")
        # an env's mean turns in the batch, and so far in the groups cut short
        turns = f"{mean('rollout/num_turns'):.2f}" + (f" / {mean('oversample/turns_unfinished'):.2f}" if over else "")
        print(f"| {name} | {wall:.2f} s | {base / wall:.2f}x | {started:.1f} | {finished:.1f} | "
              f"{mean('oversample/groups_carried'):.1f} | {mean('oversample/groups_aborted'):.1f} | "
              f"{mean('oversample/dropped_stale'):.1f} | {turns} | {mean('rollout/success'):.3f} |")


if __name__ == "__main__":
    main()
