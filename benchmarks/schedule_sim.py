"""Fixed shards against pull-based chunks, replayed on measured env costs.

    python benchmarks/schedule_sim.py [--preset env_bound_heavy] [--rollouts 3] [--workers 2 4 8 15]
        [--depth 2] [--max-env-num-per-worker N] [--save FILE] [--costs FILE]

A group's cost is the env time its envs took in a real sequential rollout of
the preset (reset plus every ``env.step``, summed over the group's envs); the
engine's time is left out, so this measures only how evenly each schedule
spreads env work over workers. The costs are replayed on simulated workers:

- fixed shards (the scheduler before pull-based chunks): ``partition`` cuts the groups into shards
  before the rollout; each shard goes, in list order, to the worker that frees
  first (a process pool with more shards than workers);
- pull-based chunks (``ragen.rollout.workers.schedule``): chunks of whole groups, of
  the sizes ``chunk_sizes`` gives, go in order to the worker that frees first.

A schedule's makespan is when its last worker ends; speedup is the total cost
over the makespan (the sequential env time over the parallel one, with no
overhead), efficiency is speedup per worker. Each rollout (its own seeds) is
replayed on its own and the median over rollouts is reported. The extra rows
cap both schedules at ``max_env_num_per_worker=4``, today's best workaround
for stragglers. ``--save`` writes the measured costs, ``--costs`` replays them
without generating rooms again.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
from pathlib import Path
from typing import Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from ragen.rollout.workers.schedule import chunk_sizes, group_costs, groups_of  # noqa: E402
from ragen.rollout.types import EnvSpec  # noqa: E402
from ragen.utils import deal  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKAROUND_CAP = 4  # max_env_num_per_worker of the comparison rows


def partition(specs: Sequence[EnvSpec], n_workers: int, max_env_num_per_worker: int | None = None) -> list[list[EnvSpec]]:
    """The fixed shards ``ParallelRolloutManager`` cut before issue 18 (here to be compared with).
    Whole groups per shard, as even as groups allow, every env assigned.
    Groups are dealt out in turn, so tags laid out in blocks (cheap rooms, then
    costly ones) are spread over all shards instead of loading one worker."""
    members = groups_of(specs)
    if not members:
        return []
    n_shards = max(1, n_workers)
    if max_env_num_per_worker:
        per_group = max(len(g) for g in members)
        per_shard = max(1, max_env_num_per_worker // per_group)
        n_shards = max(n_shards, -(-len(members) // per_shard))
    n_shards = min(n_shards, len(members))
    return [[s for g in hand for s in g] for hand in deal(members, n_shards)]


def list_schedule(job_costs: Sequence[float], n_workers: int) -> float:
    """Makespan of ``job_costs`` handed out in order, each to the worker that
    frees first (the lowest-numbered on a tie)."""
    free = [(0.0, w) for w in range(max(1, n_workers))]
    for cost in job_costs:
        t, w = heapq.heappop(free)
        heapq.heappush(free, (t + cost, w))
    return max(t for t, _ in free)


def simulate_fixed(costs_by_group: Mapping[int, float], specs: Sequence[EnvSpec], n_workers: int,
                   max_env_num_per_worker: int | None = None) -> float:
    """Makespan of today's fixed shards (``partition``) on ``n_workers`` workers."""
    shards = partition(specs, n_workers, max_env_num_per_worker)
    shard_costs = [sum(costs_by_group[g] for g in dict.fromkeys(s.group_id for s in shard)) for shard in shards]
    return list_schedule(shard_costs, n_workers)


def simulate_pull(costs: Sequence[float], n_workers: int, depth: int = 1, max_groups: int | None = None) -> float:
    """Makespan of pull-based chunks; ``costs`` per group, in ``groups_of`` order."""
    chunk_costs, start = [], 0
    for size in chunk_sizes(len(costs), n_workers, depth, max_groups):
        chunk_costs.append(sum(costs[start:start + size]))
        start += size
    return list_schedule(chunk_costs, n_workers)


def groups_cap(specs: Sequence[EnvSpec], max_env_num_per_worker: int | None) -> int | None:
    """``max_env_num_per_worker`` (envs) as whole groups, as ``partition`` counts it."""
    if not max_env_num_per_worker:
        return None
    per_group = max(len(g) for g in groups_of(specs))
    return max(1, max_env_num_per_worker // per_group)


# --------------------------- measuring and storing costs ---------------------------


def measure(preset: str, rollouts: int) -> list[dict]:
    """Per-group env costs of ``rollouts`` sequential rollouts of ``preset`` (rollout indices 0..rollouts-1)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from ragen.env import clear_caches
    from ragen.llm import make_engine
    from ragen.llm_agent import AgentSetup, LLMAgentProxy

    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base=None):
        cfg = compose(config_name="base-parallel", overrides=[f"benchmark={preset}"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["agent_proxy"]["use_parallel_rollout"] = False
    setup = AgentSetup.from_config(plain)
    engine = make_engine(cfg.engine, cfg.model_path)
    out = []
    with LLMAgentProxy(setup, engine) as proxy:
        for r in range(rollouts):
            clear_caches()  # every rollout generates its rooms
            result = proxy.rollout("train", rollout_index=r)
            cost = group_costs(result.trajectories)
            out.append({"rollout_index": r, "groups": [
                {"group_id": g[0].group_id, "env_ids": [s.env_id for s in g], "cost_s": cost[g[0].group_id]}
                for g in groups_of(result.specs)]})
            print(f"rollout {r}: {len(out[-1]['groups'])} groups, env time {sum(cost.values()):.2f} s", flush=True)
    return out


def specs_of(rollout: dict) -> list[EnvSpec]:
    """Stand-in specs with the measured rollout's env and group ids (all ``partition`` reads)."""
    return [EnvSpec(env_id=e, group_id=g["group_id"], tag="", seed=0, env_type="", env_config={})
            for g in rollout["groups"] for e in g["env_ids"]]


# --------------------------- report ---------------------------


def speedups(rollouts: list[dict], n_workers: int, depth: int, cap: int | None) -> tuple[float, float]:
    """Median speedup over rollouts of (fixed shards, pull-based chunks), both capped at ``cap`` envs a worker."""
    fixed, pull = [], []
    for rollout in rollouts:
        specs = specs_of(rollout)
        costs = [g["cost_s"] for g in rollout["groups"]]
        total = sum(costs)
        by_group = {g["group_id"]: g["cost_s"] for g in rollout["groups"]}
        fixed.append(total / simulate_fixed(by_group, specs, n_workers, cap))
        pull.append(total / simulate_pull(costs, n_workers, depth, groups_cap(specs, cap)))
    return statistics.median(fixed), statistics.median(pull)


def distribution(rollouts: list[dict]) -> str:
    costs = sorted(g["cost_s"] for r in rollouts for g in r["groups"])
    med = statistics.median(costs)
    p90 = statistics.quantiles(costs, n=10)[8] if len(costs) > 1 else costs[0]
    per = statistics.median(len(r["groups"]) for r in rollouts)
    return (f"Group env cost over {len(rollouts)} rollout(s) x {per:g} groups: median {med * 1e3:.1f} ms, "
            f"p90 {p90 * 1e3:.1f} ms, max {costs[-1] * 1e3:.1f} ms, max/median {costs[-1] / med:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="env_bound_heavy", help="config/benchmark/<preset>.yaml")
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 15])
    ap.add_argument("--depth", type=int, default=2, help="pull-based chunks: pipeline_depth")
    ap.add_argument("--max-env-num-per-worker", type=int, default=None, help="cap of both schedules (envs)")
    ap.add_argument("--save", help="write the measured costs to this JSON file")
    ap.add_argument("--costs", help="replay the costs in this JSON file instead of measuring")
    args = ap.parse_args()

    if args.costs:
        data = json.loads(Path(args.costs).read_text())
        rollouts = data["rollouts"][:args.rollouts]
    else:
        data = {"preset": args.preset, "rollouts": measure(args.preset, args.rollouts)}
        rollouts = data["rollouts"]
    if args.save:
        Path(args.save).write_text(json.dumps(data, indent=1))

    cap = args.max_env_num_per_worker
    print(f"\nPreset {data['preset']}, pull depth {args.depth}, max_env_num_per_worker {cap or 'none'}; "
          f"median over {len(rollouts)} rollout(s)\n")
    print("| workers | fixed shards speedup | fixed efficiency | pull speedup | pull efficiency |")
    print("|---|---|---|---|---|")
    rows = [(w, cap, str(w)) for w in args.workers]
    if cap != WORKAROUND_CAP:
        rows += [(w, WORKAROUND_CAP, f"{w} (max_env_num_per_worker={WORKAROUND_CAP})") for w in args.workers]
    for w, c, label in rows:
        fixed, pull = speedups(rollouts, w, args.depth, c)
        print(f"| {label} | {fixed:.2f}x | {fixed / w:.0%} | {pull:.2f}x | {pull / w:.0%} |")
    print("\n" + distribution(rollouts))


if __name__ == "__main__":
    main()
